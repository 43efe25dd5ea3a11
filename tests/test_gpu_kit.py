"""The GPU kit (benchmarks/kit/gpu_kit.py) on small fake files: calls packed as the bytes allow, parts that join back
to the file and are checked, wheels installed only where the machine lacks them, and installs that can be repeated."""

import hashlib
import io
import json
import random
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from benchmarks.kit.gpu_kit import extract_data, install, installed_versions, release, satisfies, wheels_to_install
from benchmarks.kit.gpu_kit_build import (
    STUDY_WHEELS,
    WHEELS,
    Piece,
    kit_order,
    left_out,
    plan_calls,
    repack_vllm,
    write_kit,
)


def test_calls_are_filled_in_order_and_as_few_as_the_bytes_allow():
    files = [("a.whl", 30, False), ("b.whl", 25, False), ("vllm.tar.xz", 250, True), ("model.gguf", 120, True)]
    calls = plan_calls(files, budget=100)
    # 425 bytes in calls of 100: 5 calls; vLLM fills what the wheels leave of the first, the GGUF what it leaves
    assert calls == [
        [Piece("a.whl", 0, 30, None), Piece("b.whl", 0, 25, None), Piece("vllm.tar.xz", 0, 45, 0)],
        [Piece("vllm.tar.xz", 45, 100, 1)],
        [Piece("vllm.tar.xz", 145, 100, 2)],
        [Piece("vllm.tar.xz", 245, 5, 3), Piece("model.gguf", 0, 95, 0)],
        [Piece("model.gguf", 95, 25, 1)],
    ]


def test_the_study_s_wheels_and_the_gguf_come_before_vllm():
    wheels = [Path(f"{dist}-{version}-py3-none-any.whl") for dist, version, _, _ in WHEELS]
    gguf, vllm = Path("model.gguf"), Path("vllm.tar.xz")
    order = kit_order(wheels, gguf, vllm)
    study = len(STUDY_WHEELS)
    assert order == [*wheels[:study], gguf, *wheels[study:], vllm]
    assert {path.name.split("-")[0] for path in order[:study]} >= {"trl", "datasets", "math", "gguf", "peft"}
    assert kit_order(wheels, gguf, None) == [*wheels[:study], gguf]  # --without-vllm: two calls, not four


def test_a_wheel_that_does_not_fit_what_is_left_starts_the_next_call():
    assert plan_calls([("big", 90, True), ("w.whl", 20, False)], budget=100) == [
        [Piece("big", 0, 90, 0)],
        [Piece("w.whl", 0, 20, None)],
    ]
    with pytest.raises(ValueError, match="do not fit one call"):
        plan_calls([("huge.whl", 101, False)], budget=100)


def test_versions_compare_by_release_and_floors():
    assert release("2.17.0.post1") == (2, 17, 0) and release("0.70.19") == (0, 70, 19)
    assert not satisfies("4.9.0", ">=4.10")  # 9 < 10, though "4.9" > "4.10" as strings
    assert satisfies("4.16.0", ">=4.10") and satisfies("2.50.5", "==2.50.5")
    assert not satisfies("2.50.6", "==2.50.5")  # pydantic pins its core exactly


def test_only_wheels_missing_or_too_old_there_are_installed():
    def wheel(dist, version, floor):
        return {"file": f"{dist}-{version}-py3-none-any.whl", "dist": dist, "version": version, "floor": floor}

    wheels = [
        wheel("alpha", "1.0", ">=1.0"),  # there at its version: kept out
        wheel("beta", "2.1", ">=2.1"),  # there, older: installed
        wheel("gamma", "1.0", ">=1.0"),  # missing: installed
        wheel("peft", "0.21.2", ">=0.17"),  # there, older than the kit's but new enough: kept out
        wheel("pydantic-core", "2.50.5", "==2.50.5"),  # there at another version: installed
    ]
    installed = {"alpha": "1.0", "beta": "2.0", "peft": "0.18.1", "pydantic-core": "2.50.6"}
    chosen, kept_out = wheels_to_install(wheels, installed)
    assert [w["dist"] for w in chosen] == ["beta", "gamma", "pydantic-core"]
    assert kept_out == ["alpha 1.0", "peft 0.18.1"]
    with pytest.raises(ValueError, match="must not carry torch"):
        wheels_to_install([wheel("torch", "2.13.0", ">=2.13.0")], {})


def write_dist_info(folder: Path, name: str, version: str) -> None:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_installed_versions_are_read_from_the_folders_the_first_one_winning(tmp_path):
    write_dist_info(tmp_path / "site", "Typing_Extensions", "4.16.0")
    write_dist_info(tmp_path / "machine", "typing-extensions", "4.12.2")
    write_dist_info(tmp_path / "machine", "anyio", "4.9.0")
    found = installed_versions([str(tmp_path / "site"), str(tmp_path / "machine")])
    assert found == {"typing-extensions": "4.16.0", "anyio": "4.9.0"}


def test_repacked_vllm_leaves_out_what_an_h100_does_not_load(tmp_path):
    members = [
        "vllm/__init__.py",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
        "vllm/third_party/fmha_sm100/cutlass/include/cute/tensor.hpp",
        "vllm/third_party/fmha_sm100/api.py",
    ]
    kept = {m for m in members if not left_out(m, "312")}
    assert kept == {members[0], members[2], members[6], members[8]}
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    record = "".join(f"{m},sha256=x,1\n" for m in members)
    with zipfile.ZipFile(wheel, "w") as archive:
        for member in members:
            info = zipfile.ZipInfo(member)
            info.external_attr = (0o755 if member.endswith(".so") else 0o644) << 16
            archive.writestr(info, member)
        archive.writestr("vllm-0.26.0.dist-info/RECORD", record)
    with tarfile.open(repack_vllm(wheel, tmp_path, "312")) as tar:
        assert set(tar.getnames()) == kept | {"vllm-0.26.0.dist-info/RECORD"}
        assert tar.getmember(members[2]).mode == 0o755 and tar.getmember(members[0]).mode == 0o644
        listed = tar.extractfile("vllm-0.26.0.dist-info/RECORD").read().decode()
    assert {line.split(",")[0] for line in listed.splitlines()} == kept


def fake_wheel(folder: Path) -> Path:
    """A wheel of one module, `kitdemo` 1.0, that pip installs offline."""
    path = folder / "kitdemo-1.0-py3-none-any.whl"
    files = {
        "kitdemo.py": "VALUE = 7\n",
        "kitdemo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: kitdemo\nVersion: 1.0\n",
        "kitdemo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    digest = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
    record = "".join(f"{name},sha256={digest[name]},{len(text)}\n" for name, text in files.items())
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr("kitdemo-1.0.dist-info/RECORD", record + "kitdemo-1.0.dist-info/RECORD,,\n")
    return path


@pytest.fixture
def fake_kit(tmp_path):
    """A kit of a wheel, a site archive (a package holding 4 KiB of noise) and a 3,000-byte "GGUF", in calls of
    2,500 bytes: the archive and the GGUF each split across calls."""
    sources = tmp_path / "sources"
    sources.mkdir()
    rng = random.Random(0)
    noise = bytes(rng.randrange(256) for _ in range(4096))
    archive = sources / "demo.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, data in {"demo_pkg/__init__.py": b"VALUE = 42\n", "demo_pkg/noise.bin": noise}.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    model = sources / "model.gguf"
    model.write_bytes(bytes(rng.randrange(256) for _ in range(3000)))
    wheel = fake_wheel(sources)
    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in (archive, model)}
    archives = {archive.name: {"kind": "site", "sha256": digest[archive.name]}}
    archives[model.name] = {"kind": "file", "sha256": digest[model.name]}
    wheels = {wheel.name: {"dist": "kitdemo", "version": "1.0", "floor": ">=1.0"}}
    kit = tmp_path / "kit"
    files = {path.name: path for path in (wheel, archive, model)}
    manifest, calls = write_kit(kit, files, archives, wheels, budget=2500, python="3.12")
    return kit, manifest, calls, model.read_bytes()


def run_install(tmp_path, kit):
    return install(kit, tmp_path / "work", tmp_path / "site", [str(tmp_path / "machine")])


def test_parts_arrive_over_calls_join_back_and_a_second_install_does_nothing_new(tmp_path, fake_kit):
    kit, manifest, calls, model = fake_kit
    assert calls >= 3 and all(p["size"] <= 2500 for a in manifest["archives"] for p in a["parts"])
    later = tmp_path / "later"
    later.mkdir()
    for folder in sorted(kit.glob("call-*"))[1:]:  # only the first call has arrived
        shutil.move(folder, later / folder.name)
    lines = run_install(tmp_path, kit)
    assert "installed kitdemo 1.0" in lines
    assert any(line.startswith("demo.tar.xz: waiting for .kit/call-2") for line in lines)
    assert not (tmp_path / "site" / "demo_pkg").exists()
    shutil.rmtree(kit / "call-1")  # not carried again: what arrived was kept under work/
    for folder in later.iterdir():
        shutil.move(folder, kit / folder.name)
    lines = run_install(tmp_path, kit)
    assert (tmp_path / "site" / "demo_pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (tmp_path / "work" / "model.gguf").read_bytes() == model
    assert (tmp_path / "site" / "kitdemo.py").read_text() == "VALUE = 7\n"
    again = run_install(tmp_path, kit)
    assert again == ["already there: kitdemo 1.0", "demo.tar.xz: in place", "model.gguf: in place",
                     f"GGUF: {tmp_path / 'work' / 'model.gguf'}"]  # fmt: skip


def test_a_damaged_part_is_refused(tmp_path, fake_kit):
    kit, manifest, _, _ = fake_kit
    part = next(p for a in manifest["archives"] for p in a["parts"] if a["name"] == "model.gguf")
    path = kit / part["call"] / part["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        run_install(tmp_path, kit)


def test_a_wheel_the_machine_has_is_not_installed(tmp_path, fake_kit):
    kit, _, _, _ = fake_kit
    write_dist_info(tmp_path / "machine", "kitdemo", "1.2")
    lines = run_install(tmp_path, kit)
    assert "already there: kitdemo 1.2" in lines and not (tmp_path / "site" / "kitdemo.py").exists()


def test_the_manifest_sums_every_part_and_whole(fake_kit):
    kit, manifest, _, model = fake_kit
    for entry in manifest["wheels"] + [p for a in manifest["archives"] for p in a["parts"]]:
        assert hashlib.sha256((kit / entry["call"] / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
    gguf = next(a for a in manifest["archives"] if a["name"] == "model.gguf")
    joined = b"".join((kit / p["call"] / p["file"]).read_bytes() for p in gguf["parts"])
    assert joined == model and hashlib.sha256(joined).hexdigest() == gguf["sha256"] and gguf["size"] == 3000
    assert json.loads((kit / "call-1" / "manifest.json").read_text()) == manifest


KINDS = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "link": tarfile.LNKTYPE,
         "fifo": tarfile.FIFOTYPE}  # fmt: skip


def tar_of(path: Path, members: list[tuple[str, str, str]], mode: int = 0o644) -> Path:
    """A tar of `(kind, name, the file's text or the link's target)` members (`KINDS`), files of `mode`."""
    with tarfile.open(path, "w") as tar:
        for kind, name, payload in members:
            member = tarfile.TarInfo(name)
            member.type, member.mode = KINDS[kind], mode if kind == "file" else 0o755
            data = payload.encode() if kind == "file" else b""
            member.linkname, member.size = payload if kind in ("symlink", "link") else "", len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.parametrize("filters", ["tarfile's data filter", "none (Python 3.11.2)"])
def test_an_archive_unpacks_the_same_with_or_without_tarfiles_filters(tmp_path, monkeypatch, filters):
    """Python 3.11.2 (Debian 12's) has no `filter` argument to `extractall`: the install raised `TypeError`."""
    if filters.startswith("none"):
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    members = [
        ("dir", "pkg", ""),
        ("file", "pkg/__init__.py", "VALUE = 1\n"),
        ("symlink", "pkg/alias.py", "__init__.py"),
    ]
    site = tmp_path / "site"
    with tarfile.open(tar_of(tmp_path / "good.tar", members, mode=0o4777)) as tar:
        extract_data(tar, site)
    assert (site / "pkg" / "alias.py").read_text() == "VALUE = 1\n" and (site / "pkg" / "alias.py").is_symlink()
    assert (site / "pkg" / "__init__.py").stat().st_mode & 0o7777 == 0o755  # no setuid, no group or other write


@pytest.mark.parametrize(
    ("member", "refusal"),
    [
        (("file", "../outside.txt", "x"), r"member '../outside.txt' would land outside"),
        (("file", "pkg/../../outside.txt", "x"), r"member 'pkg/../../outside.txt' would land outside"),
        (("file", "{deep}/outside.txt", "x"), r"member '/.*/deep/outside.txt' would land outside"),
        (("symlink", "pkg/up", "../../outside.txt"), r"link 'pkg/up' points outside .*: '../../outside.txt'"),
        (("symlink", "passwd", "/etc/passwd"), r"link 'passwd' points outside .*: '/etc/passwd'"),
        (("link", "hard", "../outside.txt"), r"link 'hard' points outside .*: '../outside.txt'"),
        (("fifo", "pipe", ""), r"member 'pipe' is a device or a fifo"),
    ],
    ids=["..", "inner ..", "absolute", "symlink out", "absolute symlink", "hard link out", "fifo"],
)
def test_without_tarfiles_filters_a_member_out_of_place_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, member, refusal
):
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    site = tmp_path / "deep" / "site"
    site.mkdir(parents=True)
    kind, name, payload = member
    bad = tar_of(
        tmp_path / "bad.tar", [("file", "pkg/ok.py", "x"), (kind, name.format(deep=tmp_path / "deep"), payload)]
    )
    with tarfile.open(bad) as tar, pytest.raises(ValueError, match=refusal):
        extract_data(tar, site)
    assert list(site.iterdir()) == [] and not (tmp_path / "deep" / "outside.txt").exists()


def test_the_benchmarks_readme_lists_every_pinned_wheel():
    readme = (Path(__file__).parent.parent / "benchmarks" / "README.md").read_text()
    missing = [
        dist
        for dist, version, floor, _ in WHEELS
        if f"| {dist} | {version} | {floor or '>=' + version} |" not in readme
    ]
    assert missing == []
