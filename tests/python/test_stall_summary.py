"""scripts/stall_summary.py on a stand-in of ncu's per-instruction source table."""
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "stall_summary.py")

# The shape of `ncu --page source --csv --print-source sass`: a kernel line, then the table.
TABLE = """"Kernel Name","void kernel()",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_short_sb","stall_wait","stall_wait (Not Issued)"
"0x10","      LDG.E R2, desc[UR4][R4.64]","10","4","2","0","8","8"
"0x20","      @P0 FSEL R1, R2, R3, P1","60","4","50","10","0","0"
"0x30","      HGMMA.64x64x16.F32.BF16 R8, gdesc[UR16], RZ, !UPT","30","4","0","0","10","0"
"""


@pytest.fixture
def stall_summary():
    spec = importlib.util.spec_from_file_location("stall_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text(TABLE)
    return str(path)


def test_shares_by_reason_opcode_and_range(stall_summary, table, capsys):
    assert stall_summary.main([table, "--ranges", "loads:0-0,rest:1-2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the columns' padding aside
    assert "3 instructions, 100 warp samples" in out
    assert "long_sb 52.0%" in out
    # The HGMMA's 20 samples that no column names a reason for; the predicate dropped.
    assert "unlisted 20.0%" in out
    assert "FSEL 60.0% long_sb 50.0%, short_sb 10.0%" in out
    assert "HGMMA 30.0% unlisted 20.0%, wait 10.0%" in out
    assert "loads 0-0 10.0%" in out
    assert "rest 1-2 90.0%" in out
    # The Not Issued copies of a reason are not counted twice.
    assert "wait 18.0%" in out


def test_bad_input_names_the_argument(stall_summary, table, tmp_path, capsys):
    assert stall_summary.main([table, "--ranges", "x:5"]) == 2
    assert "argument '--ranges'" in capsys.readouterr().err
    other = tmp_path / "other.csv"
    other.write_text('"Address","Source"\n"0x10","NOP"\n')
    assert stall_summary.main([str(other)]) == 2
    assert "Warp Stall Sampling (All Samples)" in capsys.readouterr().err
