"""``draftline verify`` on malformed manifests and damaged archives: only VerifyError comes out.

Small hand-made bundles (one file and its manifest) keep these tests fast; test_bundle.py
verifies real bundles.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftline.cli import main as cli_main
from draftline.stages.bundle import BUNDLE_FORMAT, MANIFEST, VerifyError, verify_bundle
from draftline.stages.bundle.archive import write_deterministic_tar

PAYLOAD = b"draft weights\n"


def good_manifest() -> dict:
    entry = {"path": "model.bin", "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
             "size": len(PAYLOAD)}
    return {"format": BUNDLE_FORMAT, "files": [entry]}


def bundle_dir(root: Path, manifest: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.bin").write_bytes(PAYLOAD)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (root / MANIFEST).write_text(text, encoding="utf-8")
    return root


def bundle_tar(tmp: Path, manifest: object) -> Path:
    tar_path = tmp / "bundle.tar"
    write_deterministic_tar(bundle_dir(tmp / "src", manifest), tar_path)
    return tar_path


def test_a_hand_made_bundle_verifies(tmp_path):
    manifest = good_manifest()
    assert verify_bundle(bundle_dir(tmp_path / "dir", manifest)) == manifest
    assert verify_bundle(bundle_tar(tmp_path, manifest)) == manifest


@pytest.mark.parametrize("files, message", [
    (None, "manifest.json: no 'files' list"),
    ([1], "manifest.json: files[0] must be an object with path, sha256 and size, got int"),
    ("model.bin", "manifest.json: 'files' must be a list of file entries, got str"),
    ([{"path": 7, "sha256": "x", "size": 1}], "manifest.json: files[0] 'path' must be a string"),
    ([{"path": ["a"], "sha256": "x", "size": 1}], "files[0] 'path' must be a string"),
    ([{"path": "model.bin", "sha256": 5, "size": 1}], "files[0] 'sha256' must be a string"),
    ([{"path": "model.bin", "sha256": "x", "size": "14"}],
     "files[0] 'size' must be a non-negative integer"),
    ([{"path": "model.bin", "sha256": "x", "size": True}],
     "files[0] 'size' must be a non-negative integer"),
])
@pytest.mark.parametrize("kind", ["dir", "tar"])
def test_malformed_file_lists_are_verify_errors(tmp_path, files, message, kind):
    manifest = {"format": BUNDLE_FORMAT}
    if files is not None:
        manifest["files"] = files
    bundle = bundle_dir(tmp_path / "b", manifest) if kind == "dir" else bundle_tar(tmp_path,
                                                                                   manifest)
    with pytest.raises(VerifyError) as err:
        verify_bundle(bundle)
    assert message in str(err.value)


def test_deeply_nested_manifest_is_a_verify_error(tmp_path):
    bundle = bundle_dir(tmp_path / "b", '{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(VerifyError, match="manifest.json: not JSON"):
        verify_bundle(bundle)


@pytest.mark.parametrize("manifest", [{"format": BUNDLE_FORMAT}, {"format": BUNDLE_FORMAT,
                                                                   "files": [1]}])
def test_cli_reports_a_malformed_manifest_without_a_traceback(tmp_path, capsys, manifest):
    bundle = bundle_tar(tmp_path, manifest)
    assert cli_main(["verify", str(bundle)]) == 1
    err = capsys.readouterr().err
    expected = ("no 'files' list" if "files" not in manifest else
                "files[0] must be an object with path, sha256 and size, got int")
    assert f"draftline verify: FAILED: bundle/manifest.json: {expected}\n" in err
    assert "Traceback" not in err


def test_truncated_archive_is_a_verify_error(tmp_path):
    tar_path = bundle_tar(tmp_path, good_manifest())
    data = tar_path.read_bytes()
    with tarfile.open(tar_path) as tar:
        payload_at = tar.getmember("bundle/model.bin").offset_data
    tar_path.write_bytes(data[: payload_at + 3])  # cut inside the payload
    with pytest.raises(VerifyError, match="bundle.tar: cannot read the archive"):
        verify_bundle(tar_path)


# ----------------------------------------------------------------------------- fuzzing

JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(["model.bin", "manifest.json", "../x", "/abs", BUNDLE_FORMAT]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["path", "sha256", "size", "files", "format", "x"]),
                      children, max_size=5),
    max_leaves=20,
)
MANIFESTS = st.one_of(
    JSON_LIKE,
    st.builds(lambda files: {"format": BUNDLE_FORMAT, "files": files}, JSON_LIKE),
    st.builds(lambda entries: {"format": BUNDLE_FORMAT, "files": entries},
              st.lists(st.dictionaries(st.sampled_from(["path", "sha256", "size"]), JSON_LIKE,
                                       max_size=3), max_size=3)),
)
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def verify_outcome(bundle: Path) -> str:
    """'ok' or 'refused': anything else escaping verify_bundle fails the test."""
    try:
        verify_bundle(bundle)
    except VerifyError as exc:
        assert str(exc)  # the message says what is wrong
        return "refused"
    return "ok"


@FUZZ
@given(manifest=MANIFESTS, as_tar=st.booleans())
def test_any_json_manifest_verifies_or_raises_verify_error(manifest, as_tar):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bundle = bundle_tar(tmp, manifest) if as_tar else bundle_dir(tmp / "b", manifest)
        outcome = verify_outcome(bundle)
    assert outcome == ("ok" if manifest == good_manifest() else "refused")


@FUZZ
@given(data=st.data())
def test_damaged_archives_raise_only_verify_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = bundle_tar(Path(tmp), good_manifest())
        damaged = bytearray(tar_path.read_bytes())
        cut = data.draw(st.integers(0, len(damaged)), label="cut")
        flips = data.draw(st.lists(st.tuples(st.integers(0, max(cut - 1, 0)),
                                             st.integers(1, 255)), max_size=4), label="flips")
        del damaged[cut:]
        for at, mask in flips:
            if at < len(damaged):
                damaged[at] ^= mask
        tar_path.write_bytes(bytes(damaged))
        verify_outcome(tar_path)


@FUZZ
@given(raw=st.binary(max_size=2048), compressed=st.sampled_from(["", "gz", "bz2", "xz"]))
def test_arbitrary_bytes_as_an_archive_raise_only_verify_error(raw, compressed):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bundle.tar"
        path.write_bytes(_compress(raw, compressed))
        assert verify_outcome(path) == "refused"


def _compress(raw: bytes, how: str) -> bytes:
    """A compressed stream whose content is garbage, so the decompressor's errors show."""
    if not how:
        return raw
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{how}") as tar:
        info = tarfile.TarInfo("bundle/junk")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    data = buf.getvalue()
    return data[: max(len(data) // 2, 1)] + raw[:16]  # cut the stream short, then garbage
