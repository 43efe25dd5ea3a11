"""The build side of `benchmarks.kit.gpu_kit` (here, with network): download the pinned wheels, repack vLLM without
what an H100 does not load, split the large files across calls of at most 64 MiB each (the working tree included) and
write `.kit/call-N` folders with one manifest of sha256 sums:

    python -m benchmarks.kit.gpu_kit_build --gguf "$(python -m trl_dapo.smollm2)"
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.kit.gpu_kit import KIT, MANIFEST, WORK, normalized, sha256_of

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one call copies: the working tree plus the carried paths
VLLM_VERSION = "0.26.0"  # the last vLLM that pins torch 2.11.0, the GPU machine's
MARGIN = 2 * MIB  # for the manifest and a working tree that grows a little before the calls

# (distribution, version, floor, why). Installed there only when missing or older than the floor (default: the
# version itself). Versions: what pip resolves for vllm==0.26.0 + trl==1.16.0 on Python 3.12 (2026-12).
# What the trainers and the real-model study need: the calls carry these, then the GGUF, before anything of vLLM's.
STUDY_WHEELS = [
    ("trl", "1.16.0", None, "TRL: GRPOTrainer and its vLLM colocate path"),
    ("datasets", "5.2.0", None, "imported by TRL"),
    ("dill", "0.4.1", None, "datasets"),
    ("multiprocess", "0.70.19", None, "datasets"),
    ("math-verify", "0.9.0", None, "the recipe's math reward"),
    ("latex2sympy2_extended", "1.11.0", None, "math-verify"),
    ("antlr4-python3-runtime", "4.13.2", None, "latex2sympy2_extended"),
    ("gguf", "0.19.0", None, "transformers reads the SmolLM2 GGUF with it"),
    ("peft", "0.21.2", ">=0.17", "LoRA (trl-dapo needs peft >= 0.17)"),
]
# What the peers need, carried after the study's: vLLM's dependencies, and Liger for TRL's tuned step (its layer
# kernels under `use_liger_kernel`; Triton comes with the machine's torch).
PEER_WHEELS = [
    ("liger-kernel", "0.8.5", None, "TRL's use_liger_kernel (bench_step --liger); TRL needs >= 0.8.2"),
    ("pydantic", "2.14.4", None, "vLLM's configs are pydantic dataclasses"),
    ("pydantic-core", "2.50.5", "==2.50.5", "pydantic (pinned exactly by it)"),
    ("annotated-types", "0.8.0", None, "pydantic"),
    ("typing-inspection", "0.4.5", None, "pydantic, fastapi"),
    ("typing-extensions", "4.16.0", None, "pydantic needs >= 4.16 (the machine's may be older)"),
    ("msgspec", "0.23.0", None, "vLLM: SamplingParams and the engine's messages"),
    ("pyzmq", "27.3.0", None, "vLLM: the engine core's sockets"),
    ("cbor2", "6.3.0", None, "vLLM: vllm.utils.hashing (prefix-cache block hashes)"),
    ("cachetools", "8.0.3", None, "vLLM: vllm.utils.cache"),
    ("pybase64", "1.5.1", None, "vLLM: multimodal media, imported by the renderers LLM uses"),
    ("fastapi", "0.136.3", None, "vLLM: LLM imports the pooling IO processor, which imports vllm.entrypoints.serve"),
    ("starlette", "1.10.0", None, "fastapi"),
    ("annotated-doc", "0.0.7", ">=0.0.2", "fastapi"),
    ("openai", "3.63.0", None, "vLLM: chat utils and tool parsers import its types at import"),
    ("httpx2", "2.17.0", None, "openai"),
    ("httpcore2", "2.17.0", None, "httpx2"),
    ("truststore", "0.10.5", None, "httpx2"),
    ("jiter", "0.19.0", None, "openai"),
    ("sniffio", "1.3.1", None, "openai"),
    ("anyio", "4.16.0", ">=4.10", "openai, starlette, httpx2 need >= 4.10"),
    ("idna", "3.21", ">=3.18", "httpx2 needs >= 3.18"),
    ("h11", "0.16.0", ">=0.16", "httpcore2 needs >= 0.16"),
    ("openai-harmony", "0.0.8", None, "vLLM: imported by vllm.reasoning and the MCP tool server at import"),
    ("partial-json-parser", "0.2.1.1.post7", None, "vLLM: tool parsers, imported by LLM"),
    ("llguidance", "1.7.6", None, "vLLM: structured outputs (the engine core imports their backends' types)"),
    ("xgrammar", "0.2.7", None, "vLLM: structured outputs, as llguidance"),
    ("apache-tvm-ffi", "0.1.10", None, "xgrammar (vLLM pins 0.1.10)"),
    ("setproctitle", "1.3.8", None, "vLLM names the engine core's process with it (skipped without)"),
    ("depyf", "0.20.0", None, "vLLM's compile debug dumps and its CUDA-graph buffer check"),
    ("astor", "0.8.1", None, "depyf"),
    ("blake3", "1.0.11", None, "vLLM's multimodal hasher (small; declared by vLLM)"),
    ("nvtx", "0.2.15", None, "vLLM's NVTX scopes for profiling (VLLM_NVTX_SCOPES_FOR_PROFILING)"),
]
WHEELS = STUDY_WHEELS + PEER_WHEELS

# Members of the vLLM wheel left out, and why (the member names match these fnmatch patterns).
VLLM_LEFT_OUT = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2: on sm_90 vLLM picks FA3 (fa_utils)",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels: imported under suppress(ImportError), called by MoE only",
    "vllm/vllm-rs": "the Rust HTTP frontend of `vllm serve` (VLLM_USE_RUST_FRONTEND)",
    "vllm/third_party/fmha_sm100/cutlass/*": "CUTLASS headers for Blackwell (sm_100) kernels",
}


def left_out(member: str, python_tag: str) -> bool:
    """Whether a wheel member stays out: the patterns above, and deep_gemm's builds for other Pythons."""
    if fnmatch.fnmatch(member, "vllm/third_party/deep_gemm/_C.cpython-*"):
        return f"cpython-{python_tag}-" not in member
    return any(fnmatch.fnmatch(member, pattern) for pattern in VLLM_LEFT_OUT)


def repack_vllm(wheel: Path, cache: Path, python_tag: str) -> Path:
    """The wheel's kept members as a tar.xz (about a third of the wheel: FA3's cubins compress 14x with xz, 4x
    with the wheel's deflate). Cached by the wheel's sha256 and the rules."""
    rules = json.dumps([sorted(VLLM_LEFT_OUT), python_tag])
    key = hashlib.sha256((sha256_of(wheel) + rules).encode()).hexdigest()[:12]
    target = cache / f"{wheel.name.split('-cp')[0]}-sm90-{key}.tar.xz"
    if target.is_file():
        return target
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as source, tarfile.open(partial, "w:xz", preset=6) as tar:
        for info in sorted(source.infolist(), key=lambda info: info.filename):
            if info.is_dir() or left_out(info.filename, python_tag):
                continue
            data = source.read(info) if info.filename.endswith("/RECORD") else None
            if data is not None:  # the RECORD names only what is unpacked
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not left_out(line.split(",")[0], python_tag)).encode()
            member = tarfile.TarInfo(info.filename)
            member.size = len(data) if data is not None else info.file_size
            member.mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            member.mtime = 0
            with source.open(info) as stream:
                tar.addfile(member, io.BytesIO(data) if data is not None else stream)
    partial.rename(target)
    return target


def pip_download(cache: Path, python_version: str, requirements: list[str]) -> None:
    """`pip download` binary wheels of `requirements` for the machine's Python and Linux (x86-64, glibc up to 2.35)."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    command += ["--python-version", python_version, "--implementation", "cp", "--dest", str(cache)]
    command += [argument for platform in platforms for argument in ("--platform", platform)]
    subprocess.run(command + requirements, check=True)


def download_wheels(cache: Path, python_version: str) -> list[Path]:
    """The pinned wheels, downloaded for the machine's Python and Linux."""
    pip_download(cache, python_version, [f"{dist}=={version}" for dist, version, _, _ in WHEELS])
    by_name = {(normalized(path.name.split("-")[0]), path.name.split("-")[1]): path for path in cache.glob("*.whl")}
    return [by_name[normalized(dist), version] for dist, version, _, _ in WHEELS]


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + size) of a kit file, carried on one call; `part` numbers a split file's pieces."""

    name: str
    offset: int
    size: int
    part: int | None


def plan_calls(files: list[tuple[str, int, bool]], budget: int) -> list[list[Piece]]:
    """Cut `(name, size, splittable)` files, in order, into calls of at most `budget` bytes each: a splittable
    file fills what is left of a call and goes on in the next, so the calls are as few as the bytes allow."""
    calls: list[list[Piece]] = [[]]
    room = budget
    for name, size, splittable in files:
        if not splittable:
            if size > budget:
                raise ValueError(f"{name}: {size} bytes do not fit one call of {budget}; carry it split")
            if size > room:
                calls.append([])
                room = budget
            calls[-1].append(Piece(name, 0, size, None))
            room -= size
            continue
        offset, part = 0, 0
        while offset < size:
            if room == 0:
                calls.append([])
                room = budget
            piece = min(room, size - offset)
            calls[-1].append(Piece(name, offset, piece, part))
            offset, part, room = offset + piece, part + 1, room - piece
    return calls


def piece_file(piece: Piece) -> str:
    return piece.name if piece.part is None else f"{piece.name}.part{piece.part:02d}"


def copy_range(source: Path, offset: int, size: int, target: Path) -> None:
    with source.open("rb") as file, target.open("wb") as out:
        file.seek(offset)
        while size:
            block = file.read(min(size, MIB))
            out.write(block)
            size -= len(block)


def write_calls(calls: list[list[Piece]], sources: dict[str, Path], kit: Path) -> list[dict]:
    """Write each call's pieces under `kit/call-N`; a manifest entry (piece, call, file, sha256, size) per piece."""
    entries = []
    for number, pieces in enumerate(calls, start=1):
        folder = kit / f"call-{number}"
        folder.mkdir(parents=True)
        for piece in pieces:
            target = folder / piece_file(piece)
            copy_range(sources[piece.name], piece.offset, piece.size, target)
            entries.append({"piece": piece, "call": folder.name, "file": target.name, "size": piece.size,
                            "sha256": sha256_of(target)})  # fmt: skip
    return entries


def make_manifest(entries: list[dict], wheels: dict[str, dict], archives: dict[str, dict], python: str) -> dict:
    """The manifest both sides read: every wheel (dist, version, floor) and archive (kind, whole sha256, parts);
    `archives`: {name: {"kind": "site" (unpacked into the site folder) or "file", "sha256": of the whole}}."""
    public = ("call", "file", "sha256", "size")
    manifest = {"built": datetime.now(UTC).isoformat(timespec="seconds"), "python": python,
                "wheels": [], "archives": [], "gguf": None}  # fmt: skip
    for entry in entries:
        name, row = entry["piece"].name, {key: entry[key] for key in public}
        if name in wheels:
            manifest["wheels"].append({**wheels[name], **row})
            continue
        if not manifest["archives"] or manifest["archives"][-1]["name"] != name:
            manifest["archives"].append({"name": name, **archives[name], "parts": []})
        manifest["archives"][-1]["parts"].append(row)
    for archive in manifest["archives"]:
        archive["size"] = sum(part["size"] for part in archive["parts"])
        manifest["gguf"] = archive["name"] if archive["kind"] == "file" else manifest["gguf"]
    return manifest


def working_tree_bytes() -> int:
    """The bytes of the working tree that travel with every call (tracked and untracked files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True)
    paths = [Path(name) for name in listed.stdout.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def call_budget(call_mib: float | None) -> int:
    if call_mib is not None:
        return int(call_mib * MIB)
    tree = working_tree_bytes()
    print(f"per call: 64 MiB - the working tree {tree / MIB:.1f} MiB - margin {MARGIN / MIB:.0f} MiB")
    return CALL_LIMIT - tree - MARGIN


def wheel_rows(wheels: list[Path]) -> dict[str, dict]:
    """{file name: manifest row} of the pinned wheels, with their floors."""
    rows = {}
    for path, (dist, version, floor, _) in zip(wheels, WHEELS, strict=True):
        rows[path.name] = {"dist": normalized(dist), "version": version, "floor": floor or f">={version}"}
    return rows


def write_kit(kit: Path, sources: dict[str, Path], archives: dict[str, dict], wheels: dict[str, dict],
              budget: int, python: str) -> tuple[dict, int]:  # fmt: skip
    """Plan the calls for `sources` (wheels whole, `archives` split), write `kit/call-N` and the manifest in each
    folder; the manifest and the number of calls."""
    files = [(name, path.stat().st_size, name in archives) for name, path in sources.items()]
    calls = plan_calls(files, budget)
    manifest = make_manifest(write_calls(calls, sources, kit), wheels, archives, python)
    for folder in [kit, *kit.glob("call-*")]:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest, len(calls)


def download_vllm(cache: Path, python_version: str) -> Path:
    """vLLM's wheel from PyPI, for the machine's Python and Linux."""
    pip_download(cache, python_version, [f"vllm=={VLLM_VERSION}"])
    return next(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))


def kit_order(wheels: list[Path], gguf: Path | None, vllm: Path | None) -> list[Path]:
    """The kit's files in the order the calls carry them: the study's wheels and the GGUF first (the study runs
    from the call that completes them), then the peers' wheels and vLLM (left out without `vllm`)."""
    study = len(STUDY_WHEELS)
    return [*wheels[:study], *([gguf] if gguf else []), *([*wheels[study:], vllm] if vllm else [])]


def build(vllm_wheel: Path | None, gguf: Path | None, call_mib: float | None, python_version: str, kit: Path,
          with_vllm: bool = True) -> None:  # fmt: skip
    """Rebuild `kit/call-*` from the pinned wheels (downloads kept in `kit/cache`), the GGUF and the vLLM wheel."""
    start = time.perf_counter()
    cache = kit / "cache"
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    for old in kit.glob("call-*"):
        shutil.rmtree(old)
    wheels = download_wheels(cache / "wheels", python_version)
    archives = {gguf.name: {"kind": "file", "sha256": sha256_of(gguf)}} if gguf else {}
    vllm = None
    if with_vllm:
        vllm_wheel = vllm_wheel or download_vllm(cache, python_version)
        vllm = repack_vllm(vllm_wheel, cache, python_version.replace(".", ""))
        archives[vllm.name] = {"kind": "site", "sha256": sha256_of(vllm)}
    sources = {path.name: path for path in kit_order(wheels, gguf, vllm)}
    rows = {name: row for name, row in wheel_rows(wheels).items() if name in sources}
    manifest, calls = write_kit(kit, sources, archives, rows, call_budget(call_mib), python_version)
    print_plan(manifest, calls, vllm_wheel if with_vllm else None)
    print(f"built in {time.perf_counter() - start:.0f} s")


def print_plan(manifest: dict, calls: int, vllm_wheel: Path | None) -> None:
    """Which folder each call carries, its size and contents, and from which call each piece is usable."""
    wheel_bytes = sum(wheel["size"] for wheel in manifest["wheels"])
    print(f"kit: {len(manifest['wheels'])} wheels ({wheel_bytes / MIB:.1f} MiB), "
          + ", ".join(f"{a['name']} ({a['size'] / MIB:.1f} MiB)" for a in manifest["archives"])
          + (f"; the vLLM wheel was {vllm_wheel.stat().st_size / MIB:.1f} MiB" if vllm_wheel else "; no vLLM"))  # fmt: skip
    for number in range(1, calls + 1):
        call = f"call-{number}"
        folder = Path(".kit") / call
        rows = [w for w in manifest["wheels"] if w["call"] == call]
        parts = [p["file"] for a in manifest["archives"] for p in a["parts"] if p["call"] == call]
        size = sum(path.stat().st_size for path in folder.iterdir())
        print(f"call {number}: carry {folder} ({size / MIB:.1f} MiB): {len(rows)} wheels, {', '.join(parts)}")
    for archive in manifest["archives"]:
        print(f"{archive['name']} usable from {archive['parts'][-1]['call']} on")
    where = f"{WORK}/{manifest['gguf']}" if manifest["gguf"] else "none"
    print(f'there, each call: eval "$(python3 -m benchmarks.kit.gpu_kit install)"   (the GGUF: {where})')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-wheel", type=Path, default=None, help="vLLM 0.26.0's wheel, if already here "
                        "(default: downloaded from PyPI into .kit/cache)")  # fmt: skip
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file to carry too")
    parser.add_argument("--call-mib", type=float, default=None, help="bytes of kit per call (default: 64 MiB less "
                        "the working tree that travels, less 2 MiB)")  # fmt: skip
    parser.add_argument("--python-version", default="3.12", help="the machine's Python, for the binary wheels")
    parser.add_argument("--without-vllm", action="store_true", help="the trainers' wheels and the GGUF alone (the "
                        "real-model study without its vLLM arm): two calls instead of four")  # fmt: skip
    args = parser.parse_args()
    build(args.vllm_wheel, args.gguf, args.call_mib, args.python_version, KIT, with_vllm=not args.without_vllm)


if __name__ == "__main__":
    main()
