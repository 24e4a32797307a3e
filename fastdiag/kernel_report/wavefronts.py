"""Shared-memory wavefronts of a compiled kernel's hot loop, with the layout the compiler chose.

Counting the *bytes* a loop moves through shared memory undercounts it whenever a warp's lanes hit
the same banks: the measured head_stats launch (commit 0c79385) read its unswizzled 512-byte-pitch
slab with ``ldmatrix``, 8 rows of one matrix in the same 4 banks, 8 wavefronts where bytes said 1
(benchmarks/RESULTS.md). So the addresses themselves are evaluated: Triton's PTX computes every
shared-memory address from ``%tid.x`` with integer arithmetic (the swizzle XORs and row pitch of the
layout it chose are in there), and this module runs that arithmetic for the 32 lanes of warp 0.

Bank model (NVIDIA, Volta and later): 32 banks of 4 bytes; a warp's request is served in phases of
at most 128 bytes (32 lanes of <= 4 B, 16 lanes of 8 B, 8 lanes of 16 B; ``ldmatrix`` /
``stmatrix``: one phase per 8 x 8 matrix, 8 rows of 16 B addressed by 8 lanes); a phase takes as
many wavefronts as the most distinct 4-byte words any one bank must serve (one word read by several
lanes is a broadcast). Global loads count one wavefront per 128 bytes a warp requests
(``cp.async`` counts its shared-memory write the same way as a store).

Values the lanes cannot know (kernel parameters, loaded data, loop-carried registers before their
first definition in text order) are taken as 0: they are the same in every lane, and a uniform
offset of a multiple of 4 bytes permutes the banks without changing any conflict. Predicates are
ignored (every lane counts), which can only overcount.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

LANES = 32
_MASK = (1 << 64) - 1

_REG = r"%[a-z]*\d+|%tid\.[xyz]|%laneid|%warpid|%ctaid\.[xyz]|%ntid\.[xyz]|%nctaid\.[xyz]"
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):(.*)$")
_HEADER = re.compile(r"Loop Header: Depth=(\d+)")


def _signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _bits(op: str) -> int:
    m = re.search(r"\.[bsuf](8|16|32|64)\b", op)
    return int(m.group(1)) if m else 32


class _Lanes:
    """Integer registers of 32 lanes, evaluated in text order."""

    def __init__(self):
        self.regs: dict[str, list[int]] = {}
        self.preds: dict[str, list[bool]] = {}

    def value(self, token: str) -> list[int]:
        token = token.strip()
        if token == "%tid.x" or token == "%laneid":
            return list(range(LANES))            # warp 0: tid.x is the lane
        if token in self.regs:
            return self.regs[token]
        m = re.fullmatch(r"(-?)0[xX]([0-9a-fA-F]+)", token)
        if m:
            v = int(m.group(2), 16)
            return [-v if m.group(1) else v] * LANES
        if re.fullmatch(r"-?\d+", token):
            return [int(token)] * LANES
        return [0] * LANES                       # params, symbols (global_smem), unknowns: uniform

    def run(self, line: str) -> None:
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(.*?);", line)
        if not m:
            return
        op, rest = m.group(1), m.group(2)
        args = [a.strip() for a in _split_args(rest)]
        if not args or not re.fullmatch(_REG, args[0]) or args[0].startswith("%f"):
            return
        name = op.split(".")[0]
        bits = _bits(op)
        v = [self.value(a) for a in args[1:]]
        if name == "setp" and len(v) >= 2:
            cmp = op.split(".")[1]
            signed = ".s" in op
            a = [_signed(x, bits) if signed else x & ((1 << bits) - 1) for x in v[0]]
            b = [_signed(x, bits) if signed else x & ((1 << bits) - 1) for x in v[1]]
            test = {"lt": int.__lt__, "le": int.__le__, "gt": int.__gt__, "ge": int.__ge__, "eq": int.__eq__,
                    "ne": int.__ne__, "lo": int.__lt__, "ls": int.__le__, "hi": int.__gt__, "hs": int.__ge__}.get(cmp)
            self.preds[args[0]] = [bool(test(x, y)) if test else True for x, y in zip(a, b)]
            return
        if args[0].startswith("%p"):
            return
        out = None
        try:
            if name == "selp":
                p = self.preds.get(args[3].strip(), [True] * LANES)
                out = [x if c else y for x, y, c in zip(v[0], v[1], p)]
            elif name in ("mov", "cvt", "cvta"):
                out = v[0]
            elif name == "add":
                out = [a + b for a, b in zip(v[0], v[1])]
            elif name == "sub":
                out = [a - b for a, b in zip(v[0], v[1])]
            elif name == "mul":
                out = [a * b for a, b in zip(v[0], v[1])]
            elif name == "mad":
                out = [a * b + c for a, b, c in zip(v[0], v[1], v[2])]
            elif name == "shl":
                out = [a << (b & 63) for a, b in zip(v[0], v[1])]
            elif name == "shr":
                signed = ".s" in op
                out = [(_signed(a, bits) if signed else a & ((1 << bits) - 1)) >> (b & 63) for a, b in zip(v[0], v[1])]
            elif name == "and":
                out = [a & b for a, b in zip(v[0], v[1])]
            elif name == "or":
                out = [a | b for a, b in zip(v[0], v[1])]
            elif name == "xor":
                out = [a ^ b for a, b in zip(v[0], v[1])]
            elif name == "not":
                out = [~a for a in v[0]]
            elif name == "neg":
                out = [-a for a in v[0]]
            elif name == "bfe":
                out = [(a >> b) & ((1 << c) - 1) for a, b, c in zip(v[0], v[1], v[2])]
            elif name == "min":
                out = [min(a, b) for a, b in zip(v[0], v[1])]
            elif name == "max":
                out = [max(a, b) for a, b in zip(v[0], v[1])]
            elif name in ("div", "rem"):
                out = [(a // b if name == "div" else a % b) if b else 0 for a, b in zip(v[0], v[1])]
        except (IndexError, TypeError):
            out = None
        self.regs[args[0]] = [x & ((1 << bits) - 1) if bits < 64 else x & _MASK for x in out] if out else [0] * LANES


def _split_args(rest: str) -> list[str]:
    """Operands of one PTX instruction; braces ({%r1, %r2}) and brackets ([%r3+64]) stay whole."""
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def _phase_wavefronts(addresses: list[int], width: int) -> int:
    """Wavefronts of one phase: lanes' ``width``-byte accesses; the most distinct words in one bank."""
    words: dict[int, set[int]] = {}
    for a in addresses:
        for w in range(a // 4, (a + max(width, 1) - 1) // 4 + 1):
            words.setdefault(w % 32, set()).add(w)
    return max((len(s) for s in words.values()), default=0)


def access_wavefronts(addresses: list[int], width: int) -> int:
    """Wavefronts of one warp-wide access of ``width`` bytes per lane at ``addresses`` (32 lanes)."""
    per_phase = max(1, 128 // max(width, 4))              # lanes served per 128-byte phase
    return sum(_phase_wavefronts(addresses[i:i + per_phase], width) for i in range(0, LANES, per_phase))


def matrix_wavefronts(addresses: list[int], matrices: int) -> int:
    """``ldmatrix`` / ``stmatrix`` of ``matrices`` 8 x 8 16-bit matrices: lanes 8m..8m+7 give the
    rows of matrix m, 16 bytes each; one phase per matrix."""
    return sum(_phase_wavefronts(addresses[8 * m:8 * m + 8], 16) for m in range(matrices))


_VEC = {"v2": 2, "v4": 4, "v8": 8}
_WIDTH = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "b32": 4, "u32": 4,
          "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8, "b128": 16}


@dataclass
class SharedAccess:
    line: int           # index into the PTX lines
    kind: str           # ldmatrix, stmatrix, ld.shared, st.shared, cp.async, ld.global, atom.shared
    bytes_per_lane: int
    wavefronts: int     # per warp-instruction
    ideal: int          # wavefronts of the same bytes without conflicts


def _address(lanes: _Lanes, operand: str) -> list[int]:
    m = re.fullmatch(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\w+))?\s*\]", operand.strip())
    if not m:
        return [0] * LANES
    base = lanes.value(m.group(1))
    off = int(m.group(2), 0) if m.group(2) else 0
    return [b + off for b in base]


def _width(op: str) -> int:
    parts = op.split(".")
    vec = next((_VEC[p] for p in parts if p in _VEC), 1)
    width = next((_WIDTH[p] for p in reversed(parts) if p in _WIDTH), 4)
    return vec * width


def classify(line: str, lanes: _Lanes) -> SharedAccess | None:
    m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(.*?);", line)
    if not m:
        return None
    op, args = m.group(1), _split_args(m.group(2))
    if op.startswith("ldmatrix") or op.startswith("stmatrix"):
        n = int(re.search(r"\.x(\d)", op).group(1))
        addr = _address(lanes, args[1] if op.startswith("ldmatrix") else args[0])
        return SharedAccess(0, op.split(".")[0], 16, matrix_wavefronts(addr, n), n)
    if op.startswith("cp.async") and ".shared" in op and len(args) >= 3:
        width = int(args[2].strip(), 0)
        addr = _address(lanes, args[0])
        return SharedAccess(0, "cp.async", width, access_wavefronts(addr, width), max(1, LANES * width // 128))
    if re.match(r"(ld|st|atom|red)\.shared\b", op):
        width = _width(op)
        addr = _address(lanes, args[1] if op.startswith("ld") or op.startswith("atom") else args[0])
        return SharedAccess(0, op.split(".")[0] + ".shared", width, access_wavefronts(addr, width),
                            max(1, LANES * width // 128))
    if op.startswith("wgmma.mma_async"):
        # a warpgroup MMA reads B (N x K) and, unless A is in registers, A (M x K) from shared memory
        # through descriptors, in the conflict-free NVMMA swizzle; each of the group's 4 warps issues it
        m_, n_, k_ = (int(x) for x in re.search(r"\.m(\d+)n(\d+)k(\d+)", op).groups())
        element = 4 if ".tf32" in op else 1 if (".e4m3" in op or ".e5m2" in op) else 2
        a_in_registers = args[1].strip().startswith("{")
        n = max(1, (n_ * k_ * element + (0 if a_in_registers else m_ * k_ * element)) // 128 // 4)
        return SharedAccess(0, "wgmma", 0, n, n)
    if re.match(r"ld\.global\b", op):
        width = _width(op)
        n = max(1, LANES * width // 128)
        return SharedAccess(0, "ld.global", width, n, n)
    return None


def _blocks(lines: list[str]) -> list[tuple[str, int, int, str]]:
    """(label, first line, end line, loop comment) of each basic block, in text order."""
    starts = [(i, m.group(1)) for i, l in enumerate(lines) if (m := _LABEL.match(l.strip()))]
    out = []
    for n, (i, label) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
        comment = " ".join(l.strip() for l in lines[i:min(end, i + 4)] if "//" in l)
        out.append((label.replace("$L__", ""), i, end, comment))
    return out


def hot_loop_lines(ptx: str) -> list[range]:
    """Line ranges (blocks) of the innermost PTX loop that loads from global memory, the first such
    loop in text order (head_stats' causal kernel has two: the full key steps come first)."""
    lines = ptx.splitlines()
    loops: dict[str, tuple[int, list[range]]] = {}        # header -> (depth, blocks)
    for label, first, end, comment in _blocks(lines):
        m = _HEADER.search(comment)
        members = []
        if m:
            members.append((label, int(m.group(1))))
        found = re.findall(r"in Loop: Header=(BB\d+_\d+) Depth=(\d+)", comment)
        members += [(h, int(d)) for h, d in found]
        for header, depth in members:
            d, blocks = loops.setdefault(header, (depth, []))
            blocks.append(range(first, end))
    loading = [(depth, min(b.start for b in blocks), blocks) for depth, blocks in loops.values()
               if any(re.search(r"\bld\.global|cp\.async\.\w+\.shared\.global", lines[i]) for b in blocks for i in b)]
    if not loading:
        raise RuntimeError("no PTX loop loading from global memory")
    deepest = max(d for d, _, _ in loading)
    _, _, blocks = min((x for x in loading if x[0] == deepest), key=lambda x: x[1])
    return blocks


@dataclass
class LoopWavefronts:
    """Per warp, per iteration of the hot loop."""
    shared: int          # shared-memory wavefronts (ldmatrix, stmatrix, LDS, STS, cp.async writes)
    shared_ideal: int    # the same accesses without bank conflicts
    global_: int         # global-load wavefronts (128 B each)
    accesses: list[SharedAccess]
    global_bytes: int = 0   # bytes the warp requests from global memory (loads and cp.async)

    @property
    def total(self) -> int:
        return self.shared + self.global_


def loop_wavefronts(ptx: str) -> LoopWavefronts:
    """Wavefronts per warp per hot-loop iteration, lane addresses evaluated for warp 0."""
    lines = ptx.splitlines()
    hot = {i for b in hot_loop_lines(ptx) for i in b}
    lanes = _Lanes()
    accesses = []
    for i, line in enumerate(lines):
        code = line.split("//")[0]
        if not code.strip() or code.strip().startswith("."):
            continue
        for stmt in code.split(";")[:-1]:            # inline asm may hold several statements a line
            stmt = stmt + ";"
            if i in hot:
                access = classify(stmt, lanes)
                if access is not None:
                    access.line = i
                    accesses.append(access)
            lanes.run(stmt)
    shared = [a for a in accesses if a.kind != "ld.global"]
    loaded = sum(LANES * a.bytes_per_lane for a in accesses if a.kind in ("ld.global", "cp.async"))
    return LoopWavefronts(sum(a.wavefronts for a in shared), sum(a.ideal for a in shared),
                          sum(a.wavefronts for a in accesses if a.kind == "ld.global"), accesses, loaded)
