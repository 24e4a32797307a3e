"""A launch's time on a GPU, predicted from its compiled code: the slowest of three streams.

- DRAM: the bytes the launch reads, at the target's read-only stream bandwidth (`device.GPUS`:
  measured on the H200, 3.5 TB/s, where its copy moved 4.0 TB/s read + write; a kernel that reads
  P once is then at most 2 x 3.5 / 4.0 = 175 % of copy).
- shared memory / L1: the hot loop's wavefronts (`wavefronts.loop_wavefronts`: the layout the
  compiler chose, bank conflicts counted), one per SM per clock.
- issue: the hot loop's warp-instructions (with the once-per-tile work where the case gives it),
  4 per SM per clock.

- latency: the bytes a launch keeps in flight per SM (resident warps x bytes a warp requests per
  hot-loop iteration x the pipeline's stages ahead) deliver at most that much per memory latency,
  ``LATENCY_S`` (an assumption — about 0.7 us loaded on Hopper-class HBM in published
  microbenchmarks — not calibrated: the measured launch was bound by shared memory).

The two on-chip streams are derated by one efficiency factor, calibrated once from the committed
Nsight Compute report of the measured launch (benchmarks/gpu_runs/2026-12-04-h200-ncu.txt,
`_head_stats_kernel`, GPT-2-small bf16): L1/TEX 94.10 % busy while the SMs were active 842,274 of
934,577 cycles, 0.941 x 0.901 = 0.848. Latency and occupancy are not modelled: a prediction is what
the busiest unit allows, not a measurement.

"% of copy" is RESULTS.md's measured column: the time of a device-to-device copy of the same tensor
(read + write) over the kernel's time.
"""
from __future__ import annotations

from dataclasses import dataclass

# ncu, _head_stats_kernel at GPT-2-small bf16 on the H200: L1/TEX busy x SM-active fraction
EFFICIENCY = 0.941 * (842_273.83 / 934_577)
LATENCY_S = 0.7e-6


@dataclass(frozen=True)
class Prediction:
    seconds: float
    bound: str                  # "dram", "shared", "issue", "latency"
    dram_s: float
    shared_s: float
    issue_s: float
    copy_s: float               # a device copy of the bytes read (read + write), 0 when no bytes given
    latency_s: float = 0.0

    @property
    def fraction_of_copy(self) -> float:
        return self.copy_s / self.seconds if self.seconds else 0.0


def predict(gpu: dict, elements: float, wavefronts_per_element: float, warp_instructions_per_element: float,
            dram_bytes: float, copy_bytes: float | None = None, in_flight_per_sm: float = 0.0,
            write_bytes: float = 0.0) -> Prediction:
    """Time of a launch over ``elements`` (loaded elements or scores) on ``gpu`` (`device.GPUS`);
    ``copy_bytes``: the tensor a "% of copy" compares with (default: the bytes read);
    ``in_flight_per_sm``: bytes the launch keeps requested per SM (0: no latency bound);
    ``write_bytes``: bytes it writes to memory (Q/K pass 2's materialised P), at the copy's rate (a copy
    moves read + write bytes at ``copy_bandwidth``: written P and P read back cost one copy of P)."""
    clocks = gpu["sms"] * gpu["clock_hz"] * EFFICIENCY
    dram = dram_bytes / gpu["read_bandwidth"] + write_bytes / gpu["copy_bandwidth"]
    shared = elements * wavefronts_per_element / clocks
    issue = elements * warp_instructions_per_element / (gpu["warp_instructions_per_clock"] * clocks)
    latency = dram_bytes * LATENCY_S / (gpu["sms"] * in_flight_per_sm) if in_flight_per_sm else 0.0
    seconds, bound = max((dram, "dram"), (shared, "shared"), (issue, "issue"), (latency, "latency"))
    copy = 2 * (dram_bytes if copy_bytes is None else copy_bytes) / gpu["copy_bandwidth"]
    return Prediction(seconds, bound, dram, shared, issue, copy, latency)


def resident_warps(registers: int, warps_per_block: int, shared_bytes: int, gpu: dict, blocks_per_sm: int = 32) -> int:
    """Warps an SM holds of a launch: registers (allocated per warp in steps of 256), shared memory,
    64 warps and ``blocks_per_sm`` blocks (the CUDA guide's limit: 32 from sm_80, 16 on sm_86/89)."""
    per_warp = -(-registers // 8) * 8 * 32
    blocks = min(gpu["registers_per_sm"] // (per_warp * warps_per_block), 64 // warps_per_block, blocks_per_sm)
    if shared_bytes:
        blocks = min(blocks, gpu["shared_bytes"] // shared_bytes)
    return max(1, blocks) * warps_per_block
