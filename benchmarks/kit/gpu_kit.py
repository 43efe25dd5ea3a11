"""The kit that brings vLLM 0.26.0, TRL and the other packages a GPU machine without network lacks (and the
SmolLM2-135M-Instruct GGUF) onto it, in parts small enough for the calls that copy files there.

Here (with network):

    python -m benchmarks.kit.gpu_kit_build --gguf "$(python -m trl_dapo.smollm2)"

writes `.kit/call-1`, `.kit/call-2`, ... (one folder to carry per call) and prints the plan. There, at the start of
every call (it copies what arrived to /tmp/kit, joins and installs what is complete, and prints the line to eval):

    eval "$(python3 -m benchmarks.kit.gpu_kit install)"
    python3 -m benchmarks.kit.gpu_kit install --check  # the first call: imports and versions, then a CUDA check

This module is the machine's side and imports the standard library alone; the build, `gpu_kit_build`, imports it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

KIT = Path(".kit")
WORK = Path("/tmp/kit")
SITE = Path("/tmp/site")
MANIFEST = "manifest.json"
# The machine's own builds, which the kit must never shadow (vLLM 0.26.0 was built against torch 2.11.0 there).
PROTECTED = frozenset({"torch", "transformers", "numpy", "triton"})
# The kit carries no FlashInfer: vLLM's sampler asks for it unless this is 0, and at top-p 1 / top-k off it samples
# in PyTorch either way. Usage stats and the hub would try the network the machine does not have.
KIT_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares it (`Typing_Extensions` and `typing-extensions` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (`2.17.0.post1` -> (2, 17, 0)): enough to tell older from newer here."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def satisfies(installed: str, floor: str) -> bool:
    """Whether an installed version meets a kit wheel's floor: `==X` exactly, else `>=X` by release."""
    if floor.startswith("=="):
        return installed == floor[2:]
    return release(installed) >= release(floor.removeprefix(">="))


def installed_versions(paths: list[str]) -> dict[str, str]:
    """{normalized name: version} of the distributions importable from `paths`, the first found winning as it
    would at import."""
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=paths):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalized(name), dist.version)
    return found


def wheels_to_install(wheels: list[dict], installed: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The kit wheels whose distribution is missing or older than their floor, and a line per wheel kept out."""
    chosen, kept_out = [], []
    for wheel in wheels:
        dist = normalized(wheel["dist"])
        if dist in PROTECTED:
            raise ValueError(f"{wheel['file']}: the kit must not carry {dist}, the machine's own build")
        have = installed.get(dist)
        if have is not None and satisfies(have, wheel["floor"]):
            kept_out.append(f"{dist} {have}")
        else:
            chosen.append(wheel)
    return chosen, kept_out


def load_manifest(kit: Path, work: Path) -> dict:
    """The newest manifest: a carried call folder's (a rebuilt kit wins) or the one kept from an earlier call."""
    found = [json.loads(path.read_text()) for path in sorted(kit.glob(f"*/{MANIFEST}"))]
    if (work / MANIFEST).is_file():
        found.append(json.loads((work / MANIFEST).read_text()))
    if not found:
        raise SystemExit(f"no kit: carry a folder of {kit}/ (run `python -m benchmarks.kit.gpu_kit_build` first)")
    return max(found, key=lambda manifest: manifest["built"])


def kit_files(manifest: dict) -> list[dict]:
    """Every file of the kit (wheels and archive parts), each with its call, sha256 and size."""
    return manifest["wheels"] + [part for archive in manifest["archives"] for part in archive["parts"]]


def has_file(path: Path, entry: dict) -> bool:
    return path.is_file() and path.stat().st_size == entry["size"] and sha256_of(path) == entry["sha256"]


def gather(kit: Path, work: Path, manifest: dict) -> list[str]:
    """Copy the carried files to `work/parts` (later calls need not carry them again), each checked first."""
    parts = work / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    copied = []
    for entry in kit_files(manifest):
        source, target = kit / entry["call"] / entry["file"], parts / entry["file"]
        if not source.is_file() or has_file(target, entry):
            continue
        if not has_file(source, entry):
            raise SystemExit(f"{source}: its sha256 or size differs from the manifest: carry it again")
        shutil.copyfile(source, target)
        copied.append(entry["size"])
    (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [f"copied {len(copied)} files ({sum(copied) / (1 << 20):.1f} MiB) to {parts}"] if copied else []


def join(archive: dict, parts: Path, whole: Path) -> None:
    """Join an archive's parts into `whole` and check the result against the manifest."""
    with whole.open("wb") as out:
        for part in archive["parts"]:
            with (parts / part["file"]).open("rb") as file:
                shutil.copyfileobj(file, out, 1 << 20)
    if sha256_of(whole) != archive["sha256"]:
        whole.unlink()
        raise SystemExit(f"{archive['name']}: the joined parts do not match the manifest's sha256")


def data_member(member: tarfile.TarInfo, target: Path) -> tarfile.TarInfo:
    """`member` as tarfile's "data" filter lets it through, checked the same way for a Python without that filter
    (before 3.11.4: Debian 12's 3.11.2): it lands inside `target` (no absolute path, no `..`), a link
    points inside it, it is a file, a folder or a link (no device, no fifo), and it keeps no setuid, setgid or sticky
    bit and no write bit for group or others. Anything else is a `ValueError` naming the member."""
    root = target.resolve()
    if member.name.startswith("/") or not (root / member.name).resolve().is_relative_to(root):
        raise ValueError(f"the archive's member {member.name!r} would land outside {target}")
    if member.issym() or member.islnk():
        base = root if member.islnk() else (root / member.name).parent
        if member.linkname.startswith("/") or not (base / member.linkname).resolve().is_relative_to(root):
            raise ValueError(f"the archive's link {member.name!r} points outside {target}: {member.linkname!r}")
    elif not (member.isfile() or member.isdir()):
        raise ValueError(f"the archive's member {member.name!r} is a device or a fifo, not a file or a folder")
    checked = copy.copy(member)
    checked.mode &= ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    return checked


def extract_data(tar: tarfile.TarFile, target: Path) -> None:
    """Unpack `tar` into `target` through tarfile's "data" filter, or `data_member`'s same checks where this Python's
    tarfile has no filters (setup.cfg admits Python 3.11 and later; 3.11.0-3.11.3 lack them)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(target, filter="data")
    else:
        tar.extractall(target, members=[data_member(member, target) for member in tar.getmembers()])


def place_archives(manifest: dict, work: Path, site: Path) -> list[str]:
    """Join each archive whose parts have all arrived; unpack a `site` one into `site`. A line per archive."""
    lines, done = [], work / "done"
    done.mkdir(parents=True, exist_ok=True)
    for archive in manifest["archives"]:
        marker, whole = done / archive["sha256"], work / archive["name"]
        if marker.is_file() and (archive["kind"] != "file" or whole.is_file()):
            lines.append(f"{archive['name']}: in place")
            continue
        missing = sorted({p["call"] for p in archive["parts"] if not has_file(work / "parts" / p["file"], p)})
        if missing:
            lines.append(f"{archive['name']}: waiting for {', '.join(f'{KIT}/{call}' for call in missing)}")
            continue
        join(archive, work / "parts", whole)
        if archive["kind"] == "site":
            with tarfile.open(whole) as tar:
                extract_data(tar, site)
            whole.unlink()
        marker.touch()
        lines.append(f"{archive['name']}: {'unpacked into ' + str(site) if archive['kind'] == 'site' else whole}")
    return lines


def install_wheels(manifest: dict, work: Path, site: Path, search: list[str]) -> list[str]:
    """pip-install (no index, no dependencies) the arrived wheels whose distribution is missing or too old."""
    arrived = [w for w in manifest["wheels"] if has_file(work / "parts" / w["file"], w)]
    waiting = sorted({w["call"] for w in manifest["wheels"] if w not in arrived})
    chosen, kept_out = wheels_to_install(arrived, installed_versions([str(site), *search]))
    if chosen:
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        command += ["--quiet", "--disable-pip-version-check", "--target", str(site)]
        subprocess.run(command + [str(work / "parts" / w["file"]) for w in chosen], check=True)
    lines = [f"installed {w['dist']} {w['version']}" for w in chosen]
    lines += [f"already there: {'; '.join(kept_out)}"] if kept_out else []
    return lines + [f"wheels waiting for {KIT}/{call}" for call in waiting]


def export_line(site: Path) -> str:
    settings = [f'PYTHONPATH="{site}:{Path.cwd()}' + '${PYTHONPATH:+:$PYTHONPATH}"']
    return "export " + " ".join(settings + [f"{key}={value}" for key, value in KIT_ENV.items()])


def install(kit: Path, work: Path, site: Path, search: list[str]) -> list[str]:
    """Everything the machine can do with what has arrived; idempotent. A line per step, for the report."""
    manifest = load_manifest(kit, work)
    site.mkdir(parents=True, exist_ok=True)
    lines = gather(kit, work, manifest)
    lines += install_wheels(manifest, work, site, search)
    lines += place_archives(manifest, work, site)
    if manifest.get("gguf"):
        lines.append(f"GGUF: {work / manifest['gguf']}")
    return lines


def check(generate: str | None) -> None:
    """Import what vLLM's offline generate and TRL's colocate mode need, print versions; on CUDA, the attention
    version vLLM picks (3 on Hopper: the kit has no FA2) and its sampler; `generate`: a short `LLM.generate`."""
    import trl.generation.vllm_generation  # noqa: F401
    import vllm  # noqa: F401  (the kit's own import check)
    from vllm import LLM, SamplingParams

    for name in ("vllm", "torch", "transformers", "trl", "pydantic", "xgrammar", "msgspec", "pyzmq", "datasets"):
        print(f"{name} {metadata.version(name)}")
    print(f"liger-kernel {metadata.version('liger-kernel')}")  # TRL's tuned step
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: imports only")
        return
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    print(f"FlashAttention version {get_flash_attn_version()}; sampler {TopKTopPSampler().forward.__name__}")
    if generate:
        llm = LLM(model=generate, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3, seed=0)
        prompts = [{"prompt_token_ids": [1 + row, 5, 7, 11]} for row in range(8)]
        outputs = llm.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32, logprobs=0))
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(f"LLM.generate: {len(outputs)} rows, {tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    install_parser = commands.add_parser("install", help="copy, join and install what has arrived (there)")
    install_parser.add_argument("--check", action="store_true", help="then run `check` under the kit's settings")
    install_parser.add_argument("--generate", default=None, help="with --check: an HF folder to generate from")
    check_parser = commands.add_parser("check", help="the imports and versions (under the kit's settings)")
    check_parser.add_argument("--generate", default=None, help="an HF folder: a short LLM.generate from it")
    args = parser.parse_args()
    if args.command == "check":
        check(args.generate)
    else:
        run_install(args.check, args.generate)


def run_install(then_check: bool, generate: str | None) -> None:
    """The report to stderr, the export line alone to stdout (for `eval`); then the check in a child process."""
    for line in install(KIT, WORK, SITE, sys.path):
        print(line, file=sys.stderr)
    line = export_line(SITE)
    print(line)
    if then_check:
        env = dict(os.environ, **KIT_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(Path.cwd()), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "benchmarks.kit.gpu_kit", "check"]
        subprocess.run(command + (["--generate", generate] if generate else []), env=env, check=True)


if __name__ == "__main__":
    main()
