"""scripts/check_spills.py against a stand-in cuobjdump: which kernels it lists and its exit status."""
import importlib.util
import os
import stat

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "check_spills.py")

# The shape of `cuobjdump --dump-resource-usage` output: an sm_80 and an sm_90a image of one object.
USAGE = """
Fatbin elf code:
================
arch = sm_80
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:0
 Function _Z6kernelILi1EEvv:
  REG:254 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:1016 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

Resource usage:
 Function _Z6kernelILi2EEvv:
  REG:168 STACK:64 SHARED:1024 LOCAL:0 CONSTANT[0]:1016 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z6kernelILi3EEvv:
  REG:128 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:1016 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


@pytest.fixture
def check_spills(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "cuobjdump"
    tool.parent.mkdir()
    listing = tmp_path / "usage.txt"
    listing.write_text(USAGE)
    tool.write_text(f"#!/bin/sh\ncat {listing}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    spec = importlib.util.spec_from_file_location("check_spills", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_frame_of_the_checked_architecture_fails(check_spills, tmp_path, capsys):
    assert check_spills.main([str(tmp_path / "usage.txt")]) == 1
    out = capsys.readouterr().out
    assert "STACK    64" in out and "1 of 2 sm_90a kernels have a stack frame" in out
    assert "REG 128" not in out  # framed kernels only, without --all


def test_other_architectures_are_checked_apart(check_spills, tmp_path, capsys):
    assert check_spills.main(["--arch", "sm_80", str(tmp_path / "usage.txt")]) == 1
    assert "1 of 1 sm_80 kernels" in capsys.readouterr().out
    assert check_spills.main(["--arch", "sm_100a", str(tmp_path / "usage.txt")]) == 2


def test_all_lists_every_kernel(check_spills, tmp_path, capsys):
    check_spills.main(["--all", str(tmp_path / "usage.txt")])
    assert "REG 128 STACK     0" in capsys.readouterr().out


# nvdisasm -g's shape: a kernel's section, line-table comments, instructions. Kernel 2 (framed,
# sm_90a) spills at two lines of a header; kernel 3 has no frame and is not listed.
LISTING = """
	.section	.text._Z6kernelILi2EEvv,"ax",@progbits
_Z6kernelILi2EEvv:
	//## File "/src/kernels/common/mask_bias.h", line 65
        /*0010*/                   STL [R1+0x8], R4 ;
        /*0020*/                   LDL.64 R6, [R1+0x8] ;
        /*0030*/                   LDL R8, [R1+0x10] ;
	//## File "/src/kernels/sm90/wgmma.h", line 30
        /*0040*/                   STL.128 [R1], R12 ;
        /*0050*/                   FADD R2, R3, R4 ;
	.section	.text._Z6kernelILi3EEvv,"ax",@progbits
_Z6kernelILi3EEvv:
	//## File "/src/kernels/common/softmax.h", line 12
        /*0010*/                   FMUL R2, R3, R4 ;
"""


@pytest.fixture
def with_disassembler(check_spills, tmp_path):
    """cuobjdump that also extracts one sm_90a and one sm_80 cubin, and an nvdisasm printing LISTING."""
    bin_dir = tmp_path / "bin"
    (tmp_path / "listing.txt").write_text(LISTING)
    (bin_dir / "cuobjdump").write_text(
        '#!/bin/sh\nif [ "$1" = "-xelf" ]; then touch k.sm_90a.cubin k.sm_80.cubin; exit 0; fi\n'
        f"cat {tmp_path / 'usage.txt'}\n")
    nvdisasm = bin_dir / "nvdisasm"
    nvdisasm.write_text(f"#!/bin/sh\ncat {tmp_path / 'listing.txt'}\n")
    nvdisasm.chmod(nvdisasm.stat().st_mode | stat.S_IEXEC)
    return check_spills


def test_lines_count_local_accesses_by_source_line(with_disassembler, tmp_path, capsys):
    assert with_disassembler.main(["--lines", str(tmp_path / "usage.txt")]) == 1
    out = capsys.readouterr().out
    assert "LDL 2, STL 2 instructions; by source line:" in out
    assert "LDL    2  mask_bias.h:65" in out and "STL    1  wgmma.h:30" in out
    assert "softmax.h" not in out


def test_lines_need_nvdisasm(check_spills, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(check_spills, "find_tool", lambda name: "" if name == "nvdisasm" else "/bin/true")
    assert check_spills.main(["--lines", str(tmp_path / "usage.txt")]) == 2
    assert "needs nvdisasm" in capsys.readouterr().err
