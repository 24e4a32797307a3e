"""The kernel report: every Triton kernel compiled for sm_90 at the benchmark shapes, no GPU needed.

Fails on spills or shared memory over the H200's limit; skips (saying why) where triton or its CUDA
tools are absent. Compiling takes seconds per kernel, so this uses the two shapes that matter most."""
import json
import os
import subprocess
import sys

import pytest
import torch

from fastdiag.bench_workloads import KERNEL_SHAPES
from fastdiag import kernel_report as report

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
        element_bytes = {"float32": 4, "float64": 8}.get(r.dtype, 2)
        instructions = r.tile_instructions_per_element or r.instructions_per_element
        assert r.issue_ceiling == pytest.approx(report.issue_ceiling(instructions, element_bytes))
        assert r.shared_ceiling == pytest.approx(report.shared_ceiling(r.wavefronts_per_element, element_bytes))
        assert r.ceiling_fraction_of_copy == pytest.approx(min(r.issue_ceiling, r.shared_ceiling, r.dram_ceiling,
                                                               r.latency_ceiling))
        assert r.wavefronts_per_element > 0 and r.conflict_factor >= 1
        if r.kernel == "head_stats":    # persistent: the tile loop is found, and costs at least its steps
            assert r.tile_instructions_per_element >= r.instructions_per_element


def test_ceiling_formulas():
    """Against a device copy of the same bf16 tensor (2 bytes read and 2 written per element at the
    copy bandwidth): the issue and wavefront rates derated by the calibrated efficiency."""
    g = report.GPU
    copy_rate = g["copy_bandwidth"] / 4                                   # bf16 elements per second
    per_element = g["sms"] * 4 * 32 * g["clock_hz"] * report.EFFICIENCY / copy_rate   # exactly at copy speed
    assert report.issue_ceiling(per_element, 2) == pytest.approx(1.0)
    assert report.issue_ceiling(2 * per_element, 2) == pytest.approx(0.5)
    assert report.issue_ceiling(per_element / 3, 2) == pytest.approx(3.0)
    wavefronts = g["sms"] * g["clock_hz"] * report.EFFICIENCY / copy_rate
    assert report.shared_ceiling(wavefronts, 2) == pytest.approx(1.0)
    assert report.shared_ceiling(2 * wavefronts, 2) == pytest.approx(0.5)
    assert report.dram_ceiling(2, 2) == pytest.approx(2 * g["read_bandwidth"] / g["copy_bandwidth"])


def test_shared_memory_bytes_of_the_hot_loop():
    sass = """
.L_x_0:
        /*0000*/                   LDG.E.128 R8, desc[UR4][R4.64] ;
        /*0010*/                   STS.128 [R3], R8 ;
        /*0020*/                   LDSM.16.M88.4 R12, [R2] ;
        /*0030*/                   LDS.U16 R6, [R2+0x10] ;
        /*0040*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0050*/                   HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24 ;
        /*0060*/              @P0 BRA `(.L_x_0) ;
"""
    # STS.128 512 + LDSM x4 512 + narrow LDS one 128-B wavefront + HGMMA (A and B shared: (64 + 32)·16·2 / 4
    # warps) + HGMMA (B shared: 32·16·2 / 4)
    assert report.hot_loop_shared_bytes(sass) == 512 + 512 + 128 + 768 + 256


def test_every_generation_compiles_with_its_own_limits():
    """A launch captured for an sm_86 target sizes pass 2 by that target's 99 KB, and the row says which
    target and limit it was compiled for."""
    from fastdiag.core.kernels import device
    from fastdiag.core.kernels import qk_stats_triton as qk
    from fastdiag.kernel_report import cases

    seen = {}
    for arch in (80, 86):
        with report._capture_compiles([qk], report.GPUS[arch]):
            seen[arch] = qk.device_limits(None)     # the launcher's probe, replaced while captured
    assert seen == {80: {"shared_bytes": 163 * 1024, "sms": 108, "arch": 80},
                    86: {"shared_bytes": 99 * 1024, "sms": 72, "arch": 86}}
    assert qk.device_limits is device.device_limits and qk.device_limits(None) is None
    configs = qk.pass2_configs(12, 12, 64, torch.bfloat16, 99 * 1024)
    estimates = [qk._tile_config_and_shared(12, 12, 64, b, n, 2, 99 * 1024)[1]
                 for b, n in ((8192, 32), (4096, 32), (2048, 16), (1024, 16))]
    assert estimates[0] > 99 * 1024 >= min(estimates)       # the preferred tiles do not fit 99 KB, smaller ones do
    assert configs[0] == qk.tile_config(12, 12, 64, 2048, 16, shared_limit=99 * 1024)    # the first that fits
    assert all(qk._shared_bytes(c, c["num_stages"], 2, 1) <= 99 * 1024 for c in configs)
    # Llama-7B's 16-bit batched tiles fit no 99-KB device: 16-bit pass 2 runs through materialised P there
    # (`qk_probs_triton`). float32 never takes the batched kernel (its 3-D float64 dots fit nowhere): its pass 2
    # is the per-head kernel's float32 plan, on the targets whose float64 dots compile to MMA (sm_80, sm_90;
    # sm_100 under triton 3.9), the torch path elsewhere
    assert qk.pass2_configs(12, 12, 64, torch.float32, 227 * 1024) == []
    assert qk.pass2_configs(32, 32, 128, torch.bfloat16, 99 * 1024) == []
    assert qk.pass2_configs(32, 32, 128, torch.bfloat16, 227 * 1024)
    assert "sm_86 llama-7b bfloat16 pass 2" not in cases.torch_path_cases(archs=(86,))
    assert "sm_86 gpt2-small float32 passes 1 + 2" in cases.torch_path_cases(archs=(86,))
    assert not [c for c in cases.torch_path_cases(archs=(80, 90)) if "float32" in c]
    assert not qk.pass1_fits(torch.float32, 99 * 1024, 86) and qk.pass1_fits(torch.float32, 163 * 1024, 80)
    assert qk.pass1_fits(torch.float32, 227 * 1024, 90) and not qk.pass1_fits(torch.float32, 227 * 1024, None)
    assert qk.pass1_fits(torch.bfloat16, 99 * 1024) and qk.pass1_fits(torch.float32, None)
    with pytest.raises(ValueError, match="archs"):
        report.kernel_report({}, archs=(75,))


# What a GPU run would show and the interpreter cannot: read from the code compiled for sm_90, in a
# subprocess without TRITON_INTERPRET (kernels cannot be compiled under it).
_EMITTED = r"""
import json, re, torch
from fastdiag.core.kernels import head_stats_triton as hs, qk_stats_triton as qk
from fastdiag import kernel_report as report
head = report.compiled_launch(lambda: hs.head_stats_triton(torch.empty(1, 1, 12, 64, 64, dtype=torch.bfloat16)))
q, mask = torch.empty(1, 2, 64, 16, dtype=torch.bfloat16), torch.empty(1, 1, 64, 64, dtype=torch.bfloat16)
lse = report.compiled_launch(lambda: qk.row_lse_triton(q, q, mask, False, 0.25))
stats = report.compiled_launch(lambda: qk.qk_stats_triton(q, q, mask, False, 0.25, lse=torch.empty(1, 2, 64)))
print(json.dumps({
    "ptrs_products": re.findall(r"%ptrs\w* = arith.muli .*: tensor<(\w+)>", head["ttir"]),
    "nan_max": [text["ptx"].count("max.NaN.f32") for text in (lse, stats)],
    "key_products": re.findall(r"%kt_ptrs\w* = arith.muli .*: tensor<(\w+)>", lse["ttir"]),
}))
"""


@pytest.fixture(scope="module")
def emitted():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _EMITTED], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pointer_offsets_are_64_bit(emitted):
    """(H − 1) · stride_ph passes 2³¹ at H = 40, T = 8192: the head × stride product of head_stats and
    the key × stride product of the Q/K kernels must be 64-bit (a 32-bit one wraps and reads wrong
    memory, silently)."""
    if not emitted["ptrs_products"]:
        pytest.skip("this triton does not name TTIR values after the kernel's variables")
    assert emitted["ptrs_products"] and all(t.endswith("i64") for t in emitted["ptrs_products"]), emitted
    assert emitted["key_products"] and all(t.endswith("i64") for t in emitted["key_products"]), emitted


def test_additive_mask_max_keeps_nan(emitted):
    """The mask clamp is a NaN-propagating max (max.NaN.f32): max.f32 drops NaN, so a NaN mask entry
    would count as masked on a GPU while the reference (and the interpreter's numpy max) keep it."""
    assert all(n > 0 for n in emitted["nan_max"]), emitted


_HEAD_BLOCKS = r"""
import json, torch
from fastdiag.kernel_report import cases as qk
from fastdiag import kernel_report as report
from fastdiag.core.kernels import qk_stats_triton as kernels
h, hk, d, t = qk.REPORT_SHAPES["llama-7b"]
q, mask = torch.empty(1, h, t, d, dtype=torch.bfloat16), torch.empty(1, 1, t, t, dtype=torch.bfloat16)
tiles = kernels.pass2_configs(h, hk, d, torch.bfloat16, report.GPU["shared_bytes"], True)[0]
def batched():      # forced: the launcher itself takes materialised P here (`qk_stats_triton`)
    kernels.qk_stats_triton(q, q, mask, False, d ** -0.5, lse=torch.empty(1, h, t), tiles=tiles)
cases = [report.ReportCase("qk_stats", f"llama-7b additive-mask{side}", "bfloat16", 2, batched,
                           qk.scores_per_iteration, launch_index=i) for i, side in enumerate(("", " off-diagonal"))]
rows = [report.report_case(c) for c in cases]
out = [[r.shape, r.spill_bytes, r.shared_bytes, r.constexprs["BLOCK_DC"]] for r in rows]
chosen = [c for c in qk._cases("llama-7b", 1, h, hk, t, d, torch.bfloat16, "additive-mask") if c.kernel == "qk_stats"]
probs = qk.probs_cases("llama-7b additive-mask", torch.bfloat16, chosen[0].launch, 1, h, hk, t, t, d, False)
out += [[r.triton_kernel, r.spill_bytes, r.shared_bytes, None] for r in (report.report_case(c) for c in probs)]
print(json.dumps(out))
"""


def test_head_blocks_under_an_additive_mask_do_not_spill():
    """Llama-7B (32 heads of 128) under an additive mask splits pass 2 into two head blocks: diagonal
    programs staged for one block, off-diagonal ones holding two, whose dot width the launcher lowers
    until the compile spills nothing (one stage: the loads pass through registers): 88 and 80 B spilled
    before. The launcher now takes materialised P there (its write kernel and the Gram, in the report's
    `probs_cases`): neither spills nor exceeds sm_90's shared memory either."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _HEAD_BLOCKS], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [shape for shape, *_ in rows] == ["llama-7b additive-mask", "llama-7b additive-mask off-diagonal",
                                             "_qk_probs_kernel", "_head_stats_kernel"]    # and what the launcher takes
    for shape, spilled, shared, _width in rows:
        assert spilled == 0 and shared <= report.GPU["shared_bytes"], rows


def test_dot_width_candidates_narrow_to_16_columns():
    from fastdiag.core.kernels import qk_stats_triton as qk

    cfg = qk.tile_config(32, 32, 128, budget=4096, block_n=16)
    assert cfg["BLOCK_HK"] == 16 and cfg["num_stages"] == 2            # the diagonal: one block, 2 stages fit
    off = qk.off_diagonal_config(cfg, 2)
    assert off["num_stages"] == 1                                      # two blocks at 2 stages: ~280 KB
    widths = [c["BLOCK_DC"] for c in qk.dot_width_candidates(off)]
    assert widths == [64, 32, 16]
    assert all(c["Q_IN_LOOP"] for c in qk.dot_width_candidates(off))
    assert [c["BLOCK_DC"] for c in qk.dot_width_candidates(qk.tile_config(12, 12, 64))] == [64, 32, 16]
    assert not qk.tile_config(12, 12, 64)["Q_IN_LOOP"] and qk.dot_width_candidates(qk.tile_config(12, 12, 64))[1]["Q_IN_LOOP"]


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
    assert "instr/elem" in result.stdout and "wavefr/elem" in result.stdout and "PREDICTED" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["kind"] == "kernel-report" and len(payload["kernels"]) == 3


def test_fp32_qk_on_a_99kb_gpu_runs_the_torch_path_and_matches_the_reference():
    """float32 Q/K on an sm_86-class GPU (99 KB): neither pass fits, so the launcher hands the whole
    computation to the chunked PyTorch path — run here for real under the report's sm_86 target (its
    shared-memory limit is what the launcher reads), no Triton kernel launched."""
    from fastdiag.core.kernels import qk_stats_triton as qk
    from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
    from fastdiag.testing import TOLERANCE, rel_err

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g)
    with report._capture_compiles([qk], report.GPUS[86]) as captured:
        got = qk.qk_stats_triton(q, k, None, True, 0.25)
    assert captured == []
    want = qk_stats_ref(q, k, None, True, 0.25)
    assert rel_err(got[0], want[0]) <= TOLERANCE[torch.float32]
    assert rel_err(got[1], want[1]) <= TOLERANCE[torch.float32]
    assert got[2].item() == want[2].item() and got[3].item() == 0


def test_wavefronts_count_bank_conflicts():
    """The bank model on hand-made lane addresses: 8 ldmatrix rows 512 bytes apart share their 4 banks
    (8 wavefronts a matrix); XOR-swizzled 16-byte columns or a 16-byte pitch take one."""
    from fastdiag.kernel_report.wavefronts import access_wavefronts, matrix_wavefronts

    lanes = range(32)
    assert matrix_wavefronts([512 * (i % 8) + 4096 * (i // 8) for i in lanes], 4) == 32      # unswizzled, 8-way
    assert matrix_wavefronts([128 * (i % 8) + 16 * ((i % 8) ^ (i // 8)) for i in lanes], 4) == 4   # swizzled
    assert matrix_wavefronts([16 * i for i in lanes], 4) == 4
    assert access_wavefronts([4 * i for i in lanes], 4) == 1              # 32 consecutive words
    assert access_wavefronts([128 * i for i in lanes], 4) == 32           # one bank, 32 words
    assert access_wavefronts([0] * 32, 4) == 1                            # broadcast
    assert access_wavefronts([16 * i for i in lanes], 16) == 4            # 128-bit: a quarter-warp a phase
    assert access_wavefronts([2 * i for i in lanes], 2) == 1              # 16-bit, 64 bytes


def test_wavefronts_read_the_lane_addresses_of_the_ptx():
    """A hand-written PTX loop: the address of each access computed from %tid.x (an XOR swizzle, a
    512-byte pitch) and counted per lane; global loads one wavefront per 128 bytes."""
    from fastdiag.kernel_report.wavefronts import loop_wavefronts

    ptx = """
	mov.u32 	%r1, %tid.x;
	and.b32 	%r2, %r1, 7;
	shl.b32 	%r3, %r2, 9;
	shr.u32 	%r4, %r1, 3;
	shl.b32 	%r5, %r4, 4;
	mov.b32 	%r9, global_smem;
	add.s32 	%r6, %r9, %r3;
	add.s32 	%r7, %r6, %r5;
	shl.b32 	%r10, %r2, 7;
	xor.b32 	%r11, %r4, %r2;
	shl.b32 	%r12, %r11, 4;
	or.b32 	%r13, %r10, %r12;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
	ld.global.v4.b32 	{%r20, %r21, %r22, %r23}, [%rd1];
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r30, %r31, %r32, %r33}, [%r7];
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r30, %r31, %r32, %r33}, [%r13+1024];
	@%p1 bra 	$L__BB0_2;
$L__BB0_3:
	ret;
"""
    w = loop_wavefronts(ptx)
    assert [a.wavefronts for a in w.accesses] == [4, 32, 4]
    assert (w.shared, w.shared_ideal, w.global_) == (36, 8, 4)


def test_the_calibrated_report_reproduces_the_measured_h200_rows():
    """Commit 0c79385's head_stats launch (what the H200 measured, benchmarks/measured/) recompiled for
    sm_90: the predicted time of each of RESULTS.md's four head_stats rows within ±25 % of the measured
    graph time (benchmarks/predict_measured.py; a subprocess, as TRITON_INTERPRET=1 cannot compile)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "predict_measured.py"), "--measured-only",
                           "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for r in rows:
        assert 0.75 <= r["ratio"] <= 1.25, r
        assert r["bound"] == "shared" and r["conflicts"] > 4, r      # the mechanism: bank conflicts
