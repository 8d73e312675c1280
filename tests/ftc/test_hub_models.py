"""Models by hub id: `org/name[@revision]` resolves through `huggingface_hub` from a cache laid out
the way the hub lays it out, offline or with the hub unreachable; names are told apart without torch;
a folder of `.bin` weights only is refused in one line.

`huggingface_hub` reads HF_HOME, HF_HUB_OFFLINE and HF_ENDPOINT when it is imported, so resolution
under a given environment runs in a fresh interpreter, as the command line would.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftc.models.hub import HubId, ModelError, commit_of, model_kind, parse_hub_id
from ftc.models.registry import resolve_model

REPO = Path(__file__).resolve().parents[2]
MAIN_SHA = "1" * 40
RELEASE_SHA = "2" * 40


def add_snapshot(cache: Path, repo_id: str, sha: str, source: Path, refs: tuple[str, ...]) -> Path:
    """Put `source`'s files in the hub cache under `cache` as snapshot `sha` of `repo_id`: content in
    `blobs/`, the snapshot folder of links to them, and `refs/<name>` files holding the sha."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    folder = repo / "snapshots" / sha
    folder.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (folder / file.name).symlink_to(os.path.relpath(blob, folder))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return folder


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, tiny_folder) -> Path:
    """An HF_HOME whose hub cache holds `tiny-org/gqa` (main: 2 layers; tag v1: 3 layers, kept as
    `refs/v1` as the hub client writes it) and `tiny-org/pickles`, with only a `.bin` for weights."""
    home = tmp_path_factory.mktemp("hf-home")
    cache = home / "hub"
    add_snapshot(cache, "tiny-org/gqa", MAIN_SHA, tiny_folder("gqa", layers=2), ("main",))
    add_snapshot(cache, "tiny-org/gqa", RELEASE_SHA, tiny_folder("gqa", layers=3), ("v1",))
    pickles = tmp_path_factory.mktemp("pickles")
    (pickles / "config.json").write_text((tiny_folder("gqa", layers=2) / "config.json").read_text())
    (pickles / "pytorch_model.bin").write_bytes(b"not read")
    add_snapshot(cache, "tiny-org/pickles", MAIN_SHA, pickles, ("main",))
    return home


RESOLVE = """
import json, sys
from ftc.models.registry import ModelError, resolve_model
out = {}
for spec in sys.argv[1:]:
    try:
        source = resolve_model(spec)
        layers = json.loads((source.path / "config.json").read_text())["num_hidden_layers"]
        out[spec] = {"kind": source.kind, "path": str(source.path), "revision": source.revision, "layers": layers}
    except ModelError as error:
        out[spec] = {"error": str(error)}
print(json.dumps(out))
"""


def resolve_in_fresh_process(specs: list[str], **env: str) -> dict[str, dict]:
    """`resolve_model` of each spec in a new interpreter with `env` added (HF_* read at import)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    result = subprocess.run(
        [sys.executable, "-c", RESOLVE, *specs],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_model_names_are_told_apart_from_the_string_alone() -> None:
    assert model_kind("smollm2-135m") == "alias"
    for hub in ("HuggingFaceTB/SmolLM2-135M", "org/name@main", "org/name@" + MAIN_SHA, "org/n.a_m-e@refs/pr/1"):
        assert model_kind(hub) == "hub", hub
    for path in ("/models/x", "./org/name", "org/name/extra", "model.gguf", "gpt2", "org/na--me", "org/..",
                 "-org/name", "org/name@", "org/name@../x", "org/name.git"):
        assert model_kind(path) == "path", path
    assert parse_hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    assert str(parse_hub_id("org/name@v1")) == "org/name@v1" and str(HubId("org/name")) == "org/name"


def test_only_a_hub_cache_snapshot_folder_has_a_commit(tmp_path: Path) -> None:
    assert commit_of(tmp_path / "snapshots" / MAIN_SHA) == MAIN_SHA
    assert commit_of(tmp_path / "other" / MAIN_SHA) is None
    assert commit_of(tmp_path / "snapshots" / "main") is None


def test_hub_ids_resolve_offline_from_the_cache_by_default_branch_tag_and_sha(hf_home: Path) -> None:
    specs = ["tiny-org/gqa", "tiny-org/gqa@v1", f"tiny-org/gqa@{MAIN_SHA}", "tiny-org/absent", "tiny-org/gqa@v9",
             "tiny-org/pickles"]
    found = resolve_in_fresh_process(specs, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    snapshots = hf_home / "hub" / "models--tiny-org--gqa" / "snapshots"
    assert found["tiny-org/gqa"] == {
        "kind": "hf", "path": str(snapshots / MAIN_SHA), "revision": MAIN_SHA, "layers": 2
    }
    assert found["tiny-org/gqa@v1"]["revision"] == RELEASE_SHA and found["tiny-org/gqa@v1"]["layers"] == 3
    assert found[f"tiny-org/gqa@{MAIN_SHA}"]["revision"] == MAIN_SHA
    for missing in ("tiny-org/absent", "tiny-org/gqa@v9"):
        error = found[missing]["error"]
        assert missing in error and "HF_HUB_OFFLINE is set" in error and str(hf_home / "hub") in error, error
        assert "hf download" in error and "\n" not in error
    assert "only PyTorch .bin weights (pytorch_model.bin)" in found["tiny-org/pickles"]["error"]


def test_an_unreachable_hub_falls_back_to_the_cache(hf_home: Path) -> None:
    """Not offline, but nothing answers at the endpoint (a closed local port): the cache serves what
    it has, and a model it lacks is named with the endpoint that could not be reached."""
    unreachable = "http://127.0.0.1:9"
    found = resolve_in_fresh_process(["tiny-org/gqa", "tiny-org/absent"], HF_HOME=str(hf_home),
                                     HF_ENDPOINT=unreachable, HF_HUB_ETAG_TIMEOUT="2")
    assert found["tiny-org/gqa"]["revision"] == MAIN_SHA
    error = found["tiny-org/absent"]["error"]
    assert f"the hub ({unreachable}) could not be reached" in error, error


def test_a_local_folder_with_only_bin_weights_is_refused_in_one_line(tmp_path: Path, tiny_folder) -> None:
    folder = tmp_path / "pickles"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_folder("gqa", layers=2) / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelError, match=r"only PyTorch \.bin weights \(pytorch_model\.bin\).*convert it"):
        resolve_model(str(folder))
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ModelError, match="has no weights"):
        resolve_model(str(folder))


def test_an_existing_local_folder_wins_over_the_hub_id_of_the_same_spelling(
    tmp_path: Path, tiny_folder, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(tiny_folder("gqa", layers=2), target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    source = resolve_model("org/name")
    assert source.path == Path("org/name") and source.kind == "hf" and source.revision is None
    assert "revision" not in source.describe()
