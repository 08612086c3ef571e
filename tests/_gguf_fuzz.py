"""A bounded, seeded fuzz of pyinfer's model-file side, run in a child process.

``python -m tests._gguf_fuzz SRC.gguf WORKDIR --seed S --cases N`` writes N mutations of SRC
(byte flips, truncations, and edits aimed at the header's counts, lengths, value and tensor types,
dims and offsets, at metadata strings and at tensor data), opens each with ``Engine`` on the CPU,
encodes a word and generates two tokens greedily. Every case must either work or raise
``PyinferError`` with a one-line message. Anything else (another exception, a case slower than
``--case-timeout`` seconds) is a failure: the child prints one JSON line per failure, then a JSON
summary, and exits 1. The parent (tests/test_gguf_hostile.py) runs it under an address-space
limit and a timeout, so a memory blow-up or a hang fails the test too; progress lines
(``case I: ...``) on stdout say which case was running.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass

import gguf
import numpy as np

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Slot:
    """One field of the file's header: where it is, how wide, what it means."""

    offset: int
    size: int
    role: str  # version, count, key_len, value_type, str_len, array_type, array_count, scalar,
    #           str_data, n_dims, dim, tensor_type, tensor_offset
    where: str  # the key or tensor it belongs to


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def header_slots(path: str) -> tuple[list[Slot], list[tuple[str, int, int, QT]], int]:
    """(header slots, (tensor name, data offset, n_bytes, type) per tensor, data start) of a
    valid file, as gguf's reader sees them."""
    r = gguf.GGUFReader(path)
    base = _addr(r.data)
    slots: list[Slot] = []

    def add(part, role, where):
        part = np.asarray(part)
        if role == "str_data" and part.nbytes == 0:
            return
        slots.append(Slot(_addr(part) - base, part.nbytes, role, where))

    for name, f in r.fields.items():
        if name == "GGUF.version":
            add(f.parts[0], "version", name)
            continue
        if name in ("GGUF.tensor_count", "GGUF.kv_count"):
            add(f.parts[0], "count", name)
            continue
        p = f.parts
        add(p[0], "key_len", name)
        add(p[1], "str_data", name)
        add(p[2], "value_type", name)
        if f.types[0] == VT.STRING:
            add(p[3], "str_len", name)
            add(p[4], "str_data", name)
        elif f.types[0] == VT.ARRAY:
            add(p[3], "array_type", name)
            add(p[4], "array_count", name)
            rest = p[5:]
            if len(f.types) > 1 and f.types[1] == VT.STRING:
                for k in range(0, len(rest), 2):
                    add(rest[k], "str_len", name)
                    add(rest[k + 1], "str_data", name)
            else:
                for part in rest:
                    add(part, "scalar", name)
        else:
            add(p[3], "scalar", name)
    for t in r.tensors:
        name_len, name_data, n_dims, dims, ttype, toff = t.field.parts
        add(name_len, "key_len", t.name)
        add(name_data, "str_data", t.name)
        add(n_dims, "n_dims", t.name)
        for k in range(len(dims)):
            slots.append(Slot(_addr(dims) - base + 8 * k, 8, "dim", t.name))
        add(ttype, "tensor_type", t.name)
        add(toff, "tensor_offset", t.name)
    tensors = [(t.name, int(t.data_offset), int(t.n_bytes), QT(t.tensor_type)) for t in r.tensors]
    return slots, tensors, int(r.data_offset)


_INT_ROLES = ("version", "count", "key_len", "value_type", "str_len", "array_type", "array_count",
              "n_dims", "dim", "tensor_type", "tensor_offset", "scalar")
# weights: how often each role is picked by an integer mutation
_ROLE_WEIGHT = {"count": 3, "array_count": 4, "str_len": 3, "key_len": 2, "value_type": 3,
                "array_type": 3, "dim": 4, "tensor_offset": 4, "tensor_type": 3, "n_dims": 2,
                "scalar": 4, "version": 1}


def _interesting(rng, orig: int, size: int) -> int:
    bits = 8 * size
    top = (1 << bits) - 1
    vals = [0, 1, 2, 7, 8, 9, 12, 13, 31, 32, 33, 255, orig + 1, orig - 1, orig * 2, orig + 32,
            orig ^ 0x80]
    if bits >= 32:
        vals += [0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE]
    if bits >= 64:
        vals += [1 << 32, (1 << 32) + 1, (1 << 63) - 1, 1 << 63, top, top - 31, 1 << 40,
                 orig << 20, orig + (1 << 62)]
    v = vals[rng.integers(len(vals))] if rng.random() < 0.85 else int(rng.integers(0, 1 << 62))
    return v & top


def _put_int(buf: bytearray, slot: Slot, value: int):
    buf[slot.offset:slot.offset + slot.size] = value.to_bytes(slot.size, "little")


def _pick(rng, items):
    return items[int(rng.integers(len(items)))]


def mutate(src: bytes, slots, tensors, data_start: int, rng) -> tuple[bytes, str]:
    """One mutation of ``src``: (new bytes, a description)."""
    buf = bytearray(src)
    kind = rng.choice(["int", "int", "int", "int", "array", "flip", "flip", "truncate", "utf8",
                       "data", "type"])
    if kind == "int":
        roles = [s for s in slots if s.role in _INT_ROLES and s.size in (1, 2, 4, 8)]
        w = np.array([_ROLE_WEIGHT.get(s.role, 1) for s in roles], float)
        # spread the picks over roles, not over the many scalar array elements
        counts = {}
        for s in roles:
            counts[s.role] = counts.get(s.role, 0) + 1
        w = w / np.array([counts[s.role] for s in roles])
        slot = roles[rng.choice(len(roles), p=w / w.sum())]
        orig = int.from_bytes(buf[slot.offset:slot.offset + slot.size], "little")
        value = _interesting(rng, orig, slot.size)
        _put_int(buf, slot, value)
        return bytes(buf), f"int {slot.role} of {slot.where} @{slot.offset}: {orig} -> {value}"
    if kind == "type":
        slot = _pick(rng, [s for s in slots if s.role in ("value_type", "array_type",
                                                          "tensor_type")])
        value = int(rng.integers(0, 42))
        _put_int(buf, slot, value)
        return bytes(buf), f"type {slot.role} of {slot.where} @{slot.offset} -> {value}"
    if kind == "array":  # a new element type and a large count together (1-byte types: no
        #                     element is ever too short to read, so gguf's loop never ends)
        arrays = [s for s in slots if s.role == "array_type"]
        slot = _pick(rng, arrays)
        etype = int(rng.choice([VT.UINT8, VT.INT8, VT.BOOL, VT.ARRAY, VT.STRING, VT.INT32, 13]))
        count = int(rng.choice([1 << 32, (1 << 32) + 7, 1 << 40, (1 << 63) + 1, 100_000]))
        _put_int(buf, slot, etype)
        buf[slot.offset + 4:slot.offset + 12] = count.to_bytes(8, "little")
        return bytes(buf), f"array of {slot.where} @{slot.offset}: type {etype}, count {count}"
    if kind == "flip":
        n = int(rng.integers(1, 9))
        pos = rng.integers(0, data_start, n)
        for p in pos:
            buf[p] = int(rng.integers(0, 256))
        return bytes(buf), f"flip {n} header bytes at {sorted(int(p) for p in pos)}"
    if kind == "truncate":
        n = int(rng.integers(0, len(src)))
        return bytes(buf[:n]), f"truncate to {n} bytes"
    if kind == "utf8":
        slot = _pick(rng, [s for s in slots if s.role == "str_data"])
        p = slot.offset + int(rng.integers(0, slot.size))
        buf[p] = int(rng.choice([0xFF, 0xC3, 0x80, 0xED]))
        return bytes(buf), f"non-UTF-8 byte in a string of {slot.where} @{p}"
    # kind == "data": poison float weights with NaN / Inf, or random bytes anywhere in the data
    name, off, nbytes, qtype = _pick(rng, tensors)
    if qtype in (QT.F32, QT.F16) and rng.random() < 0.7:
        pattern = {QT.F32: [struct.pack("<f", float("nan")), struct.pack("<f", float("inf"))],
                   QT.F16: [b"\x00\x7e", b"\x00\x7c"]}[qtype][int(rng.integers(2))]
        k = int(rng.integers(0, nbytes // len(pattern)))
        buf[off + k * len(pattern):off + (k + 1) * len(pattern)] = pattern
        return bytes(buf), f"NaN/Inf element {k} of {name}"
    for p in rng.integers(off, off + nbytes, 4):
        buf[p] = int(rng.integers(0, 256))
    return bytes(buf), f"random bytes in the data of {name}"


def run_case(path: str) -> str:
    """Open ``path`` and generate two tokens; 'ok' or 'error' (a one-line PyinferError)."""
    from pyinfer.engine import Engine
    from pyinfer.errors import PyinferError
    from pyinfer.sampler import SamplingParams

    try:
        e = Engine(path, device="cpu", n_threads=1)
        ids = e.tokenizer.encode("the") or [0]
        out = list(e.generate(ids[:1], SamplingParams(temperature=0.0), max_tokens=2, seed=0))
        e.tokenizer.decode(out)
        return "ok"
    except PyinferError as err:
        msg = str(err)
        if not msg or "\n" in msg:
            raise AssertionError(f"PyinferError message is not one line: {msg!r}") from None
        return "error"


class CaseTimeout(BaseException):  # not Exception: code under test must not swallow it
    pass


def _alarm(signum, frame):
    raise CaseTimeout()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("workdir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--case-timeout", type=int, default=10)
    args = ap.parse_args(argv)

    src = open(args.src, "rb").read()
    slots, tensors, data_start = header_slots(args.src)
    rng = np.random.default_rng(args.seed)
    signal.signal(signal.SIGALRM, _alarm)
    counts = {"ok": 0, "error": 0}
    failures = []
    t0 = time.perf_counter()
    path = os.path.join(args.workdir, "case.gguf")
    for i in range(args.cases):
        data, desc = mutate(src, slots, tensors, data_start, rng)
        with open(path, "wb") as f:
            f.write(data)
        print(f"case {i}: {desc}", flush=True)
        signal.alarm(args.case_timeout)
        try:
            counts[run_case(path)] += 1
        except CaseTimeout:
            failures.append({"case": i, "mutation": desc, "error": "timeout"})
        except BaseException as e:  # noqa: BLE001 - every other exception is what we look for
            if isinstance(e, KeyboardInterrupt):
                raise
            tb = traceback.extract_tb(e.__traceback__)[-1]
            failures.append({"case": i, "mutation": desc, "error": f"{type(e).__name__}: {e}",
                             "at": f"{tb.filename}:{tb.lineno}"})
        finally:
            signal.alarm(0)
    for f in failures:
        print("FAILURE " + json.dumps(f), flush=True)
    print("SUMMARY " + json.dumps({"cases": args.cases, **counts, "failures": len(failures),
                                   "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
