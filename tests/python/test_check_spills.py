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
