"""Faults of the tools around a run (docs/reliability.md): the export never writes into or half
over an existing output, and sample.py refuses prompts and caches it cannot honour, each with
one line and nothing on disk changed."""

import os
import subprocess
import sys
import threading

import pytest
import tokenizers

import sample
import train
from fixtures import ROOT, checkpointed_bytes_run, child_env, mounted, snapshot
from seqax import sharded_zarr
from seqax.checkpoint import Checkpointer
from seqax.config import CheckpointError, ConfigError, load_config
from seqax.data.tokenizer import JsonTokenizer
from tools import export_hf


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A run directory of a tiny bytes-tokenized model: config.yaml and checkpoint 1."""
    return checkpointed_bytes_run(tmp_path_factory.mktemp("run"))


def one_error_line(capsys, call) -> str:
    with pytest.raises(SystemExit) as exit:
        call()
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("seqax: error: "), lines
    return lines[0]


# ---------------------------------------------------------------------------------------------
# tools/export_hf.py


@pytest.mark.slow
@pytest.mark.parametrize("where", ["read_only", "full", "proc"])
def test_export_to_an_output_it_cannot_write_is_one_line(run_dir, tmp_path, where):
    """`python -m tools.export_hf` onto a read-only disk, a disk too small for the weights (64 KiB), or
    under /proc: one line naming the output, exit 2, nothing left behind."""
    disk = tmp_path / "disk"
    with mounted(disk, {"read_only": "ro", "full": "size=64k", "proc": "size=64k"}[where]):
        output = "/proc/seqax_export" if where == "proc" else str(disk / "hf")
        result = subprocess.run([sys.executable, "-m", "tools.export_hf", "--run-dir", run_dir, "--output", output],
                                cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("seqax: error: "), result.stderr[-3000:]
        cause = {"read_only": "Read-only file system", "full": "No space left on device", "proc": "No such file"}[where]
        assert f"--output {output!r}" in lines[0] and cause in lines[0], lines
        assert os.listdir(disk) == [] and not os.path.exists(output)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "file"])
def test_export_refuses_an_existing_output(run_dir, tmp_path, capsys, kind):
    output = tmp_path / "hf"
    if kind == "directory":
        output.mkdir()
        (output / "tokenizer.json").write_text("{}")
    else:
        output.write_text("mine")
    before = snapshot(tmp_path)
    line = one_error_line(capsys, lambda: export_hf.main(["--run-dir", run_dir, "--output", str(output)]))
    assert line == (f"seqax: error: --output '{output}' exists; "
                    "pass --overwrite to replace it, or choose another --output")
    assert snapshot(tmp_path) == before and (output.is_dir() == (kind == "directory"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "file"])
def test_export_overwrite_replaces_the_old_output_whole(run_dir, tmp_path, kind):
    output = tmp_path / "hf"
    if kind == "directory":
        output.mkdir()
        (output / "tokenizer.json").write_text("{}")  # the previous export's, for another dataset
        (output / "stale.bin").write_text("")  # a file this export does not write
    else:
        output.write_text("mine")
    export_hf.main(["--run-dir", run_dir, "--output", str(output), "--overwrite"])
    exported = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(output)) == exported  # the bytes tokenizer's files, not the old ones
    assert (output / "tokenizer.json").read_text() != "{}"
    assert os.listdir(tmp_path) == ["hf"]  # no temporary or old directory left


@pytest.mark.slow
def test_an_interrupted_export_leaves_nothing(run_dir, tmp_path, monkeypatch):
    output = tmp_path / "hf"
    output.mkdir()
    (output / "config.json").write_text("old")
    before = snapshot(tmp_path)

    def interrupted(path, value):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_hf, "write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf.main(["--run-dir", run_dir, "--output", str(output), "--overwrite"])
    assert snapshot(tmp_path) == before and os.listdir(tmp_path) == ["hf"]


@pytest.mark.slow
def test_export_without_safetensors_is_one_line_with_the_install_command(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as when not installed
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    line = one_error_line(capsys, lambda: export_hf.main(["--run-dir", run_dir, "--output", str(tmp_path / "hf")]))
    assert "safetensors, which is not installed: it is in requirements.txt, which `make` installs" in line
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# sample.py


@pytest.mark.slow
def test_sample_refuses_invalid_utf8(run_dir, capsys):
    prompt = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # how Python hands such argv bytes over
    line = one_error_line(capsys, lambda: sample.main(["--run-dir", run_dir, "--prompt", prompt]))
    assert line == "seqax: error: --prompt is not valid UTF-8 (byte 0xe9 at character 3); pass UTF-8 text"


def test_sample_refuses_a_prompt_its_tokenizer_cannot_encode():
    vocab = {"[UNK]": 0, "a": 1, "b": 2, " ": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # a token per character
    model.decoder = tokenizers.decoders.Fuse()
    tokenizer = JsonTokenizer(model.to_str(), "test")
    assert sample.encode_prompt(tokenizer, "ab ba") == [2, 3, 4, 3, 2]  # id + 1
    with pytest.raises(ConfigError, match=r"--prompt character 'é' \(U\+00E9, at 3\) "
                                          r"cannot be encoded by the run's tokenizer; leave it out"):
        sample.encode_prompt(tokenizer, "ab é")


@pytest.mark.slow
def test_sample_refuses_a_kv_cache_larger_than_free_memory(run_dir, capsys):
    line = one_error_line(capsys, lambda: sample.main(["--run-dir", run_dir, "--prompt", "hi",
                                                       "--max-new-tokens", "1000000000"]))
    assert ("the KV cache of 4 samples x 1000000002 positions needs 476.84 GiB, more than the" in line
            and "GiB free on cpu; lower --max-new-tokens" in line)


@pytest.mark.slow
def test_sample_with_a_dataset_that_does_not_exist_is_one_line(run_dir, capsys):
    line = one_error_line(capsys, lambda: sample.main(["--run-dir", run_dir, "--dataset", "/nonexistent/data.zarr"]))
    assert line == ("seqax: error: dataset '/nonexistent/data.zarr' (for its tokenizer) does not exist; "
                    "pass --dataset PATH of the run's flat-tokens dataset")


@pytest.mark.parametrize("text", [b"model: [unclosed\n", b"\xff\xfe not utf-8\n"], ids=["not_yaml", "not_utf8"])
def test_a_run_directory_whose_config_cannot_be_read_is_one_line(tmp_path, capsys, text):
    (tmp_path / "config.yaml").write_bytes(text)
    for tool in (lambda: sample.main(["--run-dir", str(tmp_path), "--prompt", "x"]),
                 lambda: export_hf.main(["--run-dir", str(tmp_path), "--output", str(tmp_path / "hf")])):
        line = one_error_line(capsys, tool)
        assert line.startswith(f"seqax: error: cannot read {tmp_path / 'config.yaml'}: ") and line.endswith(
            "; --run-dir must be a seqax run directory"), line


@pytest.mark.slow
def test_sample_still_generates(run_dir, capsys):
    sample.main(["--run-dir", run_dir, "--prompt", "hello", "--max-new-tokens", "3", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("--- sample 0\nhello")


# ---------------------------------------------------------------------------------------------
# Readers beside a live run: rotation may delete the checkpoint they read.


@pytest.mark.slow  # two exports of a tiny model, four checkpoints written (about 10 s)
def test_a_checkpoint_rotated_away_while_read_is_not_called_damaged(run_dir, tmp_path, monkeypatch):
    """A live run with checkpoints.keep=1 commits checkpoints 3 and 4 while the export reads checkpoint 2, and
    rotation deletes 2 under it (the export called it damaged; sample.py too: both read through
    runs.load_weights). The newest is read again and exported; an explicit --step says it was removed, not
    damaged, and names the steps there are."""
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.yaml").write_bytes(open(os.path.join(run_dir, "config.yaml"), "rb").read())
    cfg = load_config("local_test_synthetic", ["model.d_model=64", "model.n_kv=2", "model.d_head=16",
                                               "model.d_ff=128", "model.layers=1", "model.vocab=258",
                                               "+paths.model_name=live", "checkpoints.keep=1"])
    state = train.init_state(cfg, train.make_mesh(4, 2))
    # closed however the test ends: its threads would outlive a failed assertion (and fail the next tests' checks)
    with Checkpointer(str(live / "checkpoints"), cfg.checkpoints) as writer:
        for step in (1, 2):
            writer.save(step, state)
        writer.wait()
        read_chunk, saves, one_at_a_time = sharded_zarr.read_chunk, [3, 4], threading.Lock()

        def read_while_the_run_saves(*args):
            with one_at_a_time:  # the reader's threads read chunks at once
                for step in saves:  # at the first chunk read, the run saves, and rotation deletes what is read
                    writer.save(step, state)
                writer.wait()
                saves.clear()
            return read_chunk(*args)

        monkeypatch.setattr(sharded_zarr, "read_chunk", read_while_the_run_saves)
        assert export_hf.export(str(live), str(tmp_path / "hf")) == 4
        assert sorted(os.listdir(live / "checkpoints")) == ["0000000003", "0000000004"]
        saves.extend([5, 6])
        with pytest.raises(CheckpointError, match=r"checkpoint .*/0000000004 was removed while it was read \(the "
                                                  r"run's rotation, checkpoints.keep\); read a newer one: the "
                                                  r"committed steps are now \[5, 6\]"):
            export_hf.export(str(live), str(tmp_path / "hf4"), step=4)


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_sample_refuses_a_temperature_that_is_not_a_finite_non_negative_number(run_dir, capsys, temperature):
    """`--temperature nan` printed token 0s, exit 0."""
    line = one_error_line(capsys, lambda: sample.main(["--run-dir", run_dir, "--prompt", "hi", "--temperature",
                                                       temperature]))
    assert "--temperature a finite number and not negative" in line
