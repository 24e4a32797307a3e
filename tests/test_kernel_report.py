"""The kernel report: every Triton kernel compiled for sm_90 at the benchmark shapes, no GPU needed.

Fails on spills or shared memory over the H200's limit; skips (saying why) where triton or its CUDA
tools are absent. Compiling takes seconds per kernel, so this uses the two shapes that matter most."""
import json
import subprocess
import sys

import pytest

from fastdiag.bench import KERNEL_SHAPES
from fastdiag.kernels import report

pytest.importorskip("triton", reason="the kernel report compiles Triton kernels")
MISSING = report.tools_missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"CUDA tools not found: {', '.join(MISSING)} "
                                                      "(they ship with the triton wheel)")
SHAPES = {name: KERNEL_SHAPES[name] for name in ("grokking", "gpt2-small")}


@pytest.fixture(scope="module")
def rows():
    return report.kernel_report(SHAPES)


def test_every_registered_kernel_and_shape_is_reported(rows):
    assert {(r.kernel, r.shape, r.dtype) for r in rows} >= {
        ("head_stats", s, d) for s in SHAPES for d in ("float32", "float16", "bfloat16")} | {
        ("qk_lse", "gpt2-small", "bfloat16"), ("qk_stats", "gpt2-small", "bfloat16")}


def test_no_spills_and_shared_memory_within_the_limit(rows):
    for r in rows:
        assert r.spill_bytes == 0, f"{r.kernel} {r.shape} {r.dtype}: {r.spill_bytes} bytes spilled"
        assert r.shared_bytes <= report.GPU["shared_bytes"], f"{r.kernel} {r.shape} {r.dtype}: {r.shared_bytes} B shared"
        assert 0 < r.registers <= report.GPU["registers_per_thread"]


def test_counts_come_from_the_compile(rows):
    for r in rows:
        assert r.loop_instructions > 0 and r.elements_per_iteration > 0
        assert r.instructions_per_element == pytest.approx(
            r.loop_instructions * 32 * r.num_warps / r.elements_per_iteration)
        assert r.ceiling_fraction_of_copy == pytest.approx(report.issue_ceiling(r.instructions_per_element,
                                                                                {"float32": 4}.get(r.dtype, 2)))
        if r.kernel == "head_stats":    # persistent: the tile loop is found, and costs at least its steps
            assert r.tile_instructions_per_element >= r.instructions_per_element


def test_issue_ceiling_formula():
    g = report.GPU
    per_element = g["sms"] * 4 * 32 * g["clock_hz"] / (g["copy_bandwidth"] / 2)   # exactly at copy speed (bf16)
    assert report.issue_ceiling(per_element, 2) == pytest.approx(1.0)
    assert report.issue_ceiling(2 * per_element, 2) == pytest.approx(0.5)
    assert report.issue_ceiling(per_element / 3, 2) == 1.0


def test_hot_loop_is_the_innermost_loop_that_loads():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   FADD R3, R3, R2 ;
.L_x_0:
        /*0030*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0040*/              @P0 BRA `(.L_x_0) ;
        /*0050*/                   NOP ;
        /*0060*/              @P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""
    assert report.hot_loop_instructions(sass) == 5     # LDG..BRA of the outer loop, NOP not counted
    assert report.tile_loop_instructions(sass) is None  # no loading loop around it


def test_tile_loop_is_the_loop_around_the_hot_loop():
    sass = """
.L_x_1:
        /*0000*/                   IMAD R6, R7, 0x4, RZ ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   FADD R3, R3, R2 ;
        /*0030*/              @P0 BRA `(.L_x_0) ;
        /*0040*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0050*/              @P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
"""
    assert report.hot_loop_instructions(sass) == 3
    assert report.tile_loop_instructions(sass) == 6


def test_cli_kernel_report_writes_json(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "fastdiag.cli", "bench", "--kernel-report", "--shapes", "grokking",
                             "--json", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "instr/elem" in result.stdout and "ceiling" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["kind"] == "kernel-report" and len(payload["kernels"]) == 3
