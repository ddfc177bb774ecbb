"""Every stage subcommand of the ``draftline`` CLI, once, on the toy target.

Serving stages reach the session's servers (``server.mode: external``, ``bench.endpoints``)
and the hidden states come from the hf backend, so this starts no vLLM of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import requires_vllm, toy_run_config
from safetensors.numpy import load_file

from draftline.cli import COMMANDS

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def test_every_stage_subcommand_runs_once_on_the_toy(vllm_server, trained_eagle_server,
                                                    toy_target, tmp_path):
    """``draftline <stage>`` for every stage, in pipeline order, in a fresh results root: the
    serving stages reach the session's servers (server.mode external, bench.endpoints), the
    hidden states come from the hf backend, so no server is started here."""
    root = tmp_path / "results"
    cfg = merged(toy_run_config(), {
        "results": str(root),
        "target": {"toy": {"train_steps": 5}},
        "prompts": {"max_samples": 12, "num_shards": 2},
        "server": {"mode": "external", "external": {"base_urls": [vllm_server.url]}},
        "profile": {"levels": [2], "max_concurrency": 2, "num_prompts": 4, "warmup_s": 0.5,
                    "measure_s": 1, "max_truncated_share": 1},  # answers cut at 24 tokens
        "generate": {"max_tokens": 24, "concurrency": "auto"},
        "dataset": {"eval_fraction": 0.25},
        "vocab": {"min_coverage": 0},  # a toy trained 5 steps answers with any of its tokens
        "hidden": {"backend": "hf"},
        "train": {"epochs": 1, "ttt_steps": 2},
        "bench": {"num_speculative_tokens": [3], "levels": [1], "temperatures": [0.0],
                  "num_prompts": 2, "max_tokens": 16, "repetitions": 1, "warmup_s": 0.5,
                  "measure_s": 1, "endpoints": {"baseline": vllm_server.url,
                                                "eagle3-k3": trained_eagle_server.url}},
    })
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "draftline.cli"]

    def run(*args: str) -> str:
        proc = subprocess.run([*cli, *args, "--config", str(config_path)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (args, (proc.stdout + proc.stderr)[-3000:])
        return proc.stdout

    # the toy stage builds a (briefly trained) toy; the others use the served one, whose
    # weights the session's server holds
    run("toy")
    assert json.loads((root / "target/config.json").read_text())["num_hidden_layers"] == 8
    shutil.rmtree(root / "target")
    shutil.copytree(toy_target, root / "target")
    stages = ["prompts", "profile", "generate", "dataset", "vocab", "hidden", "train", "export",
              "bench", "plan", "server-stop-all", "bundle"]
    assert sorted(["toy", *stages]) == sorted(COMMANDS)  # every stage subcommand, once
    out = {stage: run(stage) for stage in stages}
    assert [len((root / f"prompts/shard-{k}.jsonl").read_text().splitlines())
            for k in range(2)] == [6, 6]
    assert json.loads((root / "profile/concurrency.json").read_text())["chosen_concurrency"] == 2
    answered = sum(len((root / f"responses/shard-{k}.jsonl").read_text().splitlines())
                   for k in range(2))
    assert answered == 12
    stats = json.loads((root / "dataset/stats.json").read_text())
    assert sum(stats["samples_out"].values()) == 12
    # each stage took its settings from the config: the draft vocab, the layers, the TTT steps
    draft_vocab = cfg["vocab"]["draft_vocab_size"]
    vocab_map = load_file(str(root / "vocab/vocab_map.safetensors"))
    assert vocab_map["d2t"].shape == (draft_vocab,) and vocab_map["t2d"].shape == (2048,)
    assert int(vocab_map["t2d"].sum()) == draft_vocab
    index = json.loads((root / "hidden/index.json").read_text())
    assert index["backend"] == "hf" and index["layer_ids"] == [2, 4, 5]
    trained = json.loads((root / "draft/eval.json").read_text())
    assert trained["ttt_steps"] == 2 and trained["layer_ids"] == [2, 4, 5]
    exported = json.loads((root / "draft/checkpoint/config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported["draft_vocab_size"] == draft_vocab and exported["vocab_size"] == 2048
    bench = json.loads((root / "bench/results.json").read_text())
    assert {r["config"] for r in bench["rows"]} == {"baseline", "eagle3-k3"}
    assert "measured" in out["plan"] and "total" in out["plan"]
    assert out["server-stop-all"].strip() == "stopped 0 shared server(s)"
    verify = subprocess.run([*cli, "verify", str(root / "bundle.tar")], capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
