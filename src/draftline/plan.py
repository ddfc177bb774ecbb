"""Capacity plan: expected disk bytes and time per stage, from a config and measured rates.

``plan(config, measured)`` runs nothing. It sizes every stage from the config, the target's
dimensions and either measured rates (the concurrency profile's peak throughput, dataset token
counts, a previous extraction's and training's tokens/s) or the stated assumptions below, and
says which one each row used. ``format_plan`` prints the table. ``python -m draftline.plan
--production`` prints the plan of the production case (Kimi-K2.5, 10,000 samples).

The numbers that matter most are exact given the token count: hidden states take
``(3 + 1) * H * dtype_size`` bytes per token (aux + final; Kimi-K2.5: 4 * 7168 * 2 = 57,344 B
= 56 KiB) plus 9 bytes of token id and loss mask. Token counts are upper bounds until the
dataset exists: every sample is assumed to use ``generate.max_tokens`` output tokens.

Import-light on purpose (no torch): ``draftline plan`` must run on the orchestrator.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from draftline.core import variants
from draftline.core.builtin_targets import builtin_target
from draftline.core.layout import Layout
from draftline.core.target import DTYPE_SIZES, NUM_AUX_LAYERS, text_config
from draftline.drafts import registry
from draftline.stages.hidden.online import online_cfg

# ----------------------------------------------------------------------------- assumptions
# Used only when nothing measured is available; each row names the ones it used.

PROMPT_TOKENS = 256  # prompt length per sample, chat template included
JSONL_BYTES_PER_TOKEN = 12  # response records: text (~4 B/token) + token id lists (~7 B/token)
PROMPT_RECORD_BYTES = 1024
ARROW_BYTES_PER_TOKEN = 9  # int64 input id + int8 loss mask
SERVER_START_S = {"cpu": 90.0, "gpu": 600.0}  # vLLM start incl. weight loading
# Output tok/s of generation at the chosen concurrency, measured: the toy on a 2-core CPU at C=64
# (docs/internals.md), Kimi-K2.5 on 8 GPUs at C=128 (docs/production.md).
GENERATE_TOK_S = {"cpu": 3_000.0, "gpu": 1_536.0}
# Hidden-state extraction (prefill only) tokens/s: hf on CPU measured on the toy; vLLM prefill
# of a 1T MoE on 8 GPUs assumed at ~6x its decode throughput.
HIDDEN_TOK_S = {"cpu": 2_000.0, "gpu": 10_000.0}
# Draft training tokens/s per unroll step count K=3 (docs/internals.md: ~3,400 tok/s on 2 CPU
# cores, toy dims); on GPUs assumed for a 7168-wide draft with bf16 and 8 ranks.
TRAIN_TOK_S = {"cpu": 3_000.0, "gpu": 40_000.0}
TOY_TRAIN_STEP_S = 0.25

# Dimensions of targets that are too large to read here (no download for a plan).
KNOWN_TARGETS = {
    "moonshotai/kimi-k2.5": {
        "hidden_size": 7168, "num_layers": 61, "vocab_size": 163840, "num_heads": 64,
        "num_kv_heads": 64, "intermediate_size": 18432, "dtype": "bfloat16",
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128,  # its MLA attention
        "weights_bytes": 595 * 10**9, "note": "Kimi-K2.5 (1T MoE, INT4 weights)",
    },
}


# ----------------------------------------------------------------------------- inputs


def target_dims(config: dict, measured: dict | None = None) -> dict | None:
    """Target dimensions: measured override, built-in target (the toy's from its config),
    local config.json, or known table."""
    if measured and measured.get("target"):
        return dict(measured["target"])
    target = config["target"]
    builtin = builtin_target(target["model"])
    if builtin and builtin.dims:
        return {**builtin.dims, "note": f"built-in target {builtin.name}: {builtin.summary}"}
    if builtin:  # the toy: target.toy sets its dimensions
        toy = target["toy"]
        return {"hidden_size": toy["hidden_size"], "num_layers": toy["num_layers"],
                "vocab_size": toy["vocab_size"], "num_heads": toy["num_heads"],
                "num_kv_heads": toy["num_heads"], "intermediate_size": toy["intermediate_size"],
                "dtype": "bfloat16", "note": "toy target (config target.toy)"}
    local = Path(target["model"]) / "config.json"
    if local.is_file():
        cfg = text_config(json.loads(local.read_text()))
        return {"hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
                "vocab_size": cfg["vocab_size"], "num_heads": cfg.get("num_attention_heads", 1),
                "num_kv_heads": cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 1),
                "intermediate_size": cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
                **{key: cfg[key] for key in MLA_KEYS if cfg.get(key)},
                "dtype": cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
                "note": f"read from {local}"}
    known = KNOWN_TARGETS.get(target["model"].lower())
    return dict(known) if known else None


def profile_output_tok_s(profile: dict | None) -> float | None:
    """Output tok/s that generation will see, from ``results/profile/concurrency.json``.

    Generation runs at the chosen concurrency, so ``chosen_output_tok_s`` comes first; then the
    peak (``peak.output_tok_s`` or ``peak_output_tok_s``); then the best of ``levels`` rows.
    """
    if not profile:
        return None
    peak = profile.get("peak") if isinstance(profile.get("peak"), dict) else {}
    for value in (profile.get("chosen_output_tok_s"), peak.get("output_tok_s"),
                  profile.get("peak_output_tok_s")):
        if value:
            return float(value)
    rates = [float(level["output_tok_s"]) for level in profile.get("levels", [])
             if isinstance(level, dict) and level.get("output_tok_s")]
    return max(rates) if rates else None


def measured_from_results(config: dict) -> dict:
    """Measured inputs found under the results root (profile, dataset stats, hidden stats)."""
    lay = Layout.from_config(config)
    sources = {"profile": lay.profile_json, "dataset": lay.dataset_stats,
               "hidden": lay.hidden_stats, "online": lay.online_stats,
               "generation": lay.generation_summary}
    measured = {}
    for key, path in sources.items():
        if path.is_file():
            try:
                measured[key] = json.loads(path.read_text())
            except ValueError:
                continue
    rate = training_step_rate(lay.train_metrics)
    if rate:
        measured["train_sample_tok_s"] = rate
    return measured


def training_step_rate(metrics: Path) -> float | None:
    """The median tokens/s of an earlier training's optimizer steps (its metrics.jsonl: one
    record a step with ``tokens_per_s``, the evaluations without), or None."""
    if not metrics.is_file():
        return None
    rates = []
    for line in metrics.read_text().splitlines():
        try:
            rate = json.loads(line).get("tokens_per_s")
        except (ValueError, AttributeError):
            continue  # a torn last line of a running training
        if rate:
            rates.append(float(rate))
    return statistics.median(rates) if rates else None


def free_disk(config: dict) -> tuple[int | None, str]:
    """Free bytes for results: ``hidden.free_bytes`` if set, else measured on the results disk."""
    if config["hidden"].get("free_bytes") is not None:
        return int(config["hidden"]["free_bytes"]), "config hidden.free_bytes"
    probe = Path(config["results"]).absolute()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free, f"free on the disk of {probe}"


# ----------------------------------------------------------------------------- sizing


MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def draft_params(dims: dict, draft_vocab: int, architecture: dict | None = None) -> int:
    """Trainable parameters of the draft (embedding shared, not counted); ``architecture`` is
    ``train.draft`` (null entries keep the target's sizes). Its family counts them
    (``draftline.drafts.registry.trainable_params``)."""
    return registry.trainable_params(dims, draft_vocab, architecture)


def expected_answers(config: dict) -> int:
    """Answers the run asks for: ``prompts.max_samples``, a training prompt's
    ``generate.answers_per_prompt`` times (the eval split's once)."""
    prompts, share = config["prompts"]["max_samples"], config["dataset"]["eval_fraction"]
    return round(prompts * (share + (1 - share) * config["generate"]["answers_per_prompt"]))


# measured answers within this share of the answers a config asks describe its run (the eval
# split is drawn by hash, so its size moves by a few prompts with prompts.max_samples)
SAME_ANSWERS = 0.02


def _token_counts(config: dict, measured: dict) -> tuple[int, int, int, str]:
    """(samples, tokens, output tokens) of the dataset, measured or as an upper bound. Stats
    measured on a run that asked for other answers (prompts.max_samples,
    generate.answers_per_prompt) are scaled per answer to the ones this config asks."""
    stats = measured.get("dataset") or {}
    if stats.get("tokens"):
        tokens = int(sum(stats["tokens"].values()))
        samples = int(sum(stats.get("samples_out", {}).values())
                      or config["prompts"]["max_samples"])
        supervised = int(sum(stats.get("supervised_tokens", {}).values()) or tokens)
        asked, expected = int(stats.get("records_read") or 0), expected_answers(config)
        if not asked or abs(expected / asked - 1) <= SAME_ANSWERS:
            return samples, tokens, supervised, "dataset/stats.json"
        scale = expected / asked
        return (round(samples * scale), round(tokens * scale), round(supervised * scale),
                f"dataset/stats.json scaled from its {asked:,} answers to the {expected:,} "
                "this config asks")
    samples = expected_answers(config)
    out = config["generate"]["max_tokens"]
    per_sample = min(config["dataset"]["max_length"], PROMPT_TOKENS + out)
    basis = (f"upper bound: {samples:,} samples x {per_sample:,} tokens "
             f"({PROMPT_TOKENS} prompt assumed + generate.max_tokens {out:,}, "
             f"capped at dataset.max_length)")
    return samples, samples * per_sample, samples * min(out, per_sample), basis


def _row(stage: str, disk: int | None, time_s: float | None, basis: str, **extra) -> dict:
    return {"stage": stage, "disk_bytes": disk, "time_s": time_s, "basis": basis, **extra}


def plan(config: dict, measured: dict | None = None) -> list[dict]:
    """Rows per stage: ``stage``, ``disk_bytes``, ``time_s``, ``basis`` (+ stage details).

    ``config`` is a validated config (defaults filled). ``measured`` may hold ``profile``
    (concurrency.json), ``dataset`` (dataset/stats.json), ``hidden`` (extract_stats.json),
    ``target`` (dimensions) and rates ``generate_tok_s``, ``hidden_tok_s``, ``train_tok_s``
    (supervised tokens) or ``train_sample_tok_s`` (an earlier training's steps, every token).
    The last row is the total, with the free disk and whether it suffices.
    """
    measured = dict(measured or {})
    # the built-in targets are small enough for the CPU; a given target is planned for GPUs
    kind = "cpu" if builtin_target(config["target"]["model"]) else "gpu"
    dims = target_dims(config, measured)
    samples, tokens, out_tokens, token_basis = _token_counts(config, measured)
    prompts = config["prompts"]["max_samples"]
    rows = [
        _target_row(config, dims, kind),
        _row("prompts", prompts * PROMPT_RECORD_BYTES, 1.0,
             f"{prompts:,} prompts x ~{PROMPT_RECORD_BYTES} B (assumed)"),
        _profile_row(config, measured, kind),
        _generate_row(config, measured, kind, tokens, out_tokens, token_basis),
        _row("dataset", tokens * ARROW_BYTES_PER_TOKEN, tokens / 200_000,
             f"{tokens:,} tokens x {ARROW_BYTES_PER_TOKEN} B (input id + mask); {token_basis}"),
        _vocab_row(config, dims),
        _hidden_row(config, measured, dims, kind, tokens, token_basis),
        *_train_rows(config, measured, dims, kind, out_tokens, tokens, tokens / max(samples, 1)),
    ]
    modes = hidden_modes(config, rows)
    if modes and config["hidden"]["mode"] == "online":  # the extraction moves into training
        online = modes["online"]
        hidden = next(r for r in rows if r["stage"] == "hidden")
        rows[rows.index(hidden)] = _row(
            "hidden", online["peak_disk_bytes"], 0.0,
            "hidden.mode online: no stored states; produced for each training job "
            f"(at most {_bytes(online['buffer_bytes'])} "
            + ("in the vllm producer's spool)" if online["peak_disk_bytes"] else "buffered)"))
        for train in (r for r in rows if r["stage"].startswith("train")):
            train["time_s"] += online["produce_s"]
            train["basis"] += (f"; + {online['extractions']:g} x "
                               f"{online['produce_s'] / online['extractions']:,.0f} s producing "
                               f"the states at {hidden['tok_s']:,.0f} tok/s (online: the first "
                               "epoch, and later epochs beyond the epoch cache)")
    rows.append(_total_row(config, rows))
    if modes:
        rows[-1]["modes"] = modes
    return rows


def hidden_modes(config: dict, rows: list[dict]) -> dict | None:
    """Peak disk of the hidden states and time of extraction + training, per hidden.mode.

    Offline stores every sample's states once (disk: the hidden row) and extracts once.
    Online stores none and runs the target in the first epoch and again in every later one
    for the share of states its epoch cache cannot hold (hf: ``epoch_cache_bytes`` in memory;
    vllm: no cache): ``1 + (epochs - 1) x (1 - cached share)`` extractions. It holds at most
    the buffer: in memory with the hf producer (inside the training job), on disk with the
    vllm producer (the server's spool folder). Online, each training (the main draft's and
    every variant's) produces its own states.
    """
    hidden = next(r for r in rows if r["stage"] == "hidden")
    trains = [r for r in rows if r["stage"].startswith("train")]
    if hidden["disk_bytes"] is None or trains[0]["time_s"] is None:
        return None
    train_s = sum(r["time_s"] for r in trains)
    epochs = config["train"]["epochs"]
    online = online_cfg(config["hidden"])
    batch_bytes = config["train"]["batch_tokens"] * hidden["state_bytes_per_token"]
    buffer = min(online["max_buffer_bytes"], (online["prefetch"] + 1) * batch_bytes)
    cache = online["epoch_cache_bytes"]
    states_bytes = hidden["tokens"] * hidden["state_bytes_per_token"]
    cached = (min(1.0, cache / states_bytes)
              if config["hidden"]["backend"] == "hf" and states_bytes else 0.0)
    extractions = round(1 + (epochs - 1) * (1 - cached), 2)
    produce_s = extractions * hidden["tokens"] / hidden["tok_s"]
    return {
        "offline": {"peak_disk_bytes": hidden["disk_bytes"],
                    "time_s": hidden["time_s"] + train_s, "extractions": 1},
        "online": {"peak_disk_bytes": buffer if config["hidden"]["backend"] == "vllm" else 0,
                   "buffer_bytes": buffer, "produce_s": produce_s,
                   "backend": config["hidden"]["backend"],
                   "time_s": train_s + len(trains) * produce_s, "extractions": extractions,
                   "epochs": epochs, "cached_share": round(cached, 4)},
    }


def _target_row(config: dict, dims: dict | None, kind: str) -> dict:
    builtin = builtin_target(config["target"]["model"])
    if builtin and builtin.dims:
        size = builtin.dims["weights_bytes"]
        return _row("target", size, builtin.build_s,
                    f"{builtin.name}: {size / 1e6:,.0f} MB of bf16 weights, built in "
                    f"~{builtin.build_s:.0f} s (measured)")
    if not builtin:
        size = (dims or {}).get("weights_bytes")
        return _row("target", 0, 0.0, f"existing model {config['target']['model']}"
                    + (f" ({size / 1e9:,.0f} GB of weights, not written)" if size else ""))
    toy = config["target"]["toy"]
    h, layers, vocab, inter = (toy["hidden_size"], toy["num_layers"], toy["vocab_size"],
                               toy["intermediate_size"])
    params = 2 * vocab * h + layers * (4 * h * h + 3 * h * inter)
    steps = toy["train_steps"]
    return _row("target", params * 2, steps * TOY_TRAIN_STEP_S,
                f"toy: {params / 1e6:.1f} M params in bf16; {steps} train steps x "
                f"{TOY_TRAIN_STEP_S} s (assumed)")


def server_start(measured: dict, kind: str) -> tuple[float, str]:
    """(seconds, basis) of one vLLM server start: an earlier generation's, from its jobs'
    start to their first request (the median over its shards; the server's start and weight
    loading, nearly all of it), else the assumption for ``kind``."""
    startup = ((measured.get("generation") or {}).get("startup_s") or {}).get("per_shard")
    starts = sorted(float(s) for s in startup or [] if s)
    if starts:
        return starts[len(starts) // 2], "measured by an earlier generation"
    return SERVER_START_S[kind], "assumed"


def _profile_row(config: dict, measured: dict, kind: str) -> dict:
    prof = config["profile"]
    start, start_basis = server_start(measured, kind)
    earlier = measured_sweep(measured.get("profile"), prof)
    if earlier:
        level_s, levels = earlier
        return _row("profile", 10_000, levels * level_s + start,
                    f"{levels} levels x {level_s:.0f} s (measured by an earlier profile) + "
                    f"server start {start:.0f} s ({start_basis})")
    levels = len(prof["levels"])
    seconds = levels * (prof["warmup_s"] + prof["measure_s"]) + start
    return _row("profile", 10_000, seconds,
                f"{levels} levels x ({prof['warmup_s']} + {prof['measure_s']}) s (assumed) + "
                f"server start {start:.0f} s ({start_basis})")


def measured_sweep(profile: dict | None, prof: dict) -> tuple[float, int] | None:
    """(seconds a level, levels) from an earlier profile of the same windows: a level waits
    for answers to turn over, which the windows alone do not tell. The same requested levels
    are planned as that sweep ran them, extensions included; other levels as requested."""
    if not profile or not profile.get("duration_s") or not profile.get("levels_measured"):
        return None
    if (profile.get("warmup_s"), profile.get("measure_s")) != (prof["warmup_s"],
                                                                prof["measure_s"]):
        return None
    level_s = float(profile["duration_s"]) / len(profile["levels_measured"])
    same = list(profile.get("levels_requested") or []) == list(prof["levels"])
    return level_s, len(profile["levels_measured"]) if same else len(prof["levels"])


def _generate_row(config: dict, measured: dict, kind: str, tokens: int, out_tokens: int,
                  token_basis: str) -> dict:
    rate = measured.get("generate_tok_s") or profile_output_tok_s(measured.get("profile"))
    rate_basis = "measured by the concurrency profile" if rate else "assumed"
    rate = rate or GENERATE_TOK_S[kind]
    return _row("generate", tokens * JSONL_BYTES_PER_TOKEN, out_tokens / rate,
                f"{out_tokens:,} output tokens at {rate:,.0f} tok/s ({rate_basis}); "
                f"records ~{JSONL_BYTES_PER_TOKEN} B/token (assumed)", tok_s=rate)


def draft_vocab_size(config: dict, dims: dict | None) -> int:
    """The draft vocab the vocab stage chooses: never more than the target's."""
    requested = config["vocab"]["draft_vocab_size"]
    return min(requested, (dims or {}).get("vocab_size") or requested)


def _vocab_row(config: dict, dims: dict | None) -> dict:
    draft_vocab = draft_vocab_size(config, dims)
    target_vocab = (dims or {}).get("vocab_size", 0)
    return _row("vocab", draft_vocab * 8 + target_vocab, 10.0,
                f"d2t int64 [{draft_vocab:,}] + t2d bool [{target_vocab:,}]")


def _hidden_row(config: dict, measured: dict, dims: dict | None, kind: str, tokens: int,
                token_basis: str) -> dict:
    if not dims:
        return _row("hidden", None, None, "target dimensions unknown: pass measured['target'] "
                    "(hidden_size, num_layers, vocab_size) or use a local model dir")
    hidden_cfg = config["hidden"]
    dtype = dims.get("dtype", "bfloat16")
    layers = NUM_AUX_LAYERS + 1  # aux + final
    state_bytes = layers * dims["hidden_size"] * DTYPE_SIZES.get(dtype, 2)
    per_token = state_bytes + ARROW_BYTES_PER_TOKEN
    rate = measured.get("hidden_tok_s") or (measured.get("hidden") or {}).get("tokens_per_s")
    rate_basis = "measured by an earlier extraction"
    if not rate and (measured.get("online") or {}).get("producer_tok_s"):
        rate = measured["online"]["producer_tok_s"]
        rate_basis = "measured by an online training's producer (draft/hidden_stats.json)"
    rate_basis = rate_basis if rate else "assumed"
    rate = rate or HIDDEN_TOK_S[kind]
    start, start_basis = (server_start(measured, kind) if hidden_cfg["backend"] == "vllm"
                          else (30.0, "assumed"))
    return _row("hidden", tokens * per_token, tokens / rate + start,
                f"{tokens:,} tokens x ({state_bytes:,} B states = {layers} x "
                f"{dims['hidden_size']:,} x {DTYPE_SIZES.get(dtype, 2)} B {dtype} + "
                f"{ARROW_BYTES_PER_TOKEN} B ids/mask); "
                f"{rate:,.0f} tok/s ({rate_basis}, backend {hidden_cfg['backend']}) + model "
                f"load {start:.0f} s ({start_basis}); {token_basis}",
                state_bytes_per_token=state_bytes, bytes_per_token=per_token, tok_s=rate,
                tokens=tokens)


def _train_rows(config: dict, measured: dict, dims: dict | None, kind: str,
                out_tokens: int, tokens: int, sample_tokens: float) -> list[dict]:
    """The main draft's training, each variant's (train.variants: the same loop on the same
    states, its own draft), the benchmark, and the bundle that holds every checkpoint."""
    if not dims:
        return [_row("train", None, None, "target dimensions unknown")]
    trains = [_train_row("train", variants.main_train(config["train"]), config, measured,
                         dims, kind, out_tokens, tokens, sample_tokens)]
    trains += [_train_row(f"train {name}", variants.variant_train(config["train"], name),
                          config, measured, dims, kind, out_tokens, tokens, sample_tokens)
               for name in variants.variant_names(config["train"])]
    checkpoints = sum(r["checkpoint_bytes"] for r in trains)
    return [*trains, _bench_row(config, measured, kind),
            _row("bundle", 2 * checkpoints, 2 * checkpoints / 200e6,
                 f"{len(trains)} draft checkpoint(s) twice (folder + tar)")]


def _train_row(stage: str, train: dict, config: dict, measured: dict, dims: dict, kind: str,
               out_tokens: int, tokens: int, sample_tokens: float) -> dict:
    params = draft_params(dims, draft_vocab_size(config, dims), train.get("draft"))
    checkpoint = params * 2  # bf16 export
    # fp32 weights and gradients plus the optimizer's moments (AdamW 2; Muon's matrices, nearly
    # all of the draft, 1), one state kept
    state = params * (12 if train["optimizer"] == "muon" else 16)
    passes, passes_basis = draft_passes(train, sample_tokens)
    rate, rate_basis = measured.get("train_tok_s"), "measured"
    if not rate and measured.get("train_sample_tok_s"):
        # a step's tokens/s counts every token of its samples; the estimate counts supervised
        rate = measured["train_sample_tok_s"] * out_tokens / max(tokens, 1)
        rate_basis = ("measured by an earlier training (draft/metrics.jsonl), "
                      f"{measured['train_sample_tok_s']:,.0f} tok/s of whole samples")
    if not rate:
        rate, rate_basis = TRAIN_TOK_S[kind] * 3 / passes, "assumed"  # ~ linear in passes
    probes = lr_probe_share(train)
    seconds = train["epochs"] * out_tokens / rate * (1 + probes)
    probe_note = (f"; lr auto: {len(train['lr_search']['candidates'])} probes of "
                  f"{train['lr_search']['probe_fraction']:.0%} of the steps (+{probes:.0%})"
                  if probes else "")
    return _row(stage, checkpoint + state, seconds,
                f"{drafting_name(train.get('draft'))} draft {params / 1e6:,.1f} M trainable "
                f"params (+ shared embedding), {_bytes(state)} training state (fp32 weights, "
                f"gradients, moments); {train['epochs']} epochs x {out_tokens:,} supervised "
                f"tokens at {rate:,.0f} tok/s ({rate_basis}, {passes_basis}){probe_note}",
                draft_params=params, checkpoint_bytes=checkpoint, state_bytes=state)


def draft_passes(train: dict, sample_tokens: float) -> tuple[float, str]:
    """How many one-layer passes over a sample's tokens a training step costs (assumed, for
    the time estimate), as the draft's family says: an EAGLE-3 draft's unroll steps; a DFlash
    draft's layers, each over the context and the blocks."""
    draft = train.get("draft") or {}
    return registry.for_draft(draft).train_passes(train, draft, sample_tokens)


def drafting_name(architecture: dict | None) -> str:
    """The draft's family as the benchmark labels it (``draftline.drafts.registry.label``)."""
    return registry.label(architecture)


def lr_probe_share(train: dict) -> float:
    """The extra training ``train.lr: auto`` costs, as a share of the run: its probes (at
    least ``min_probe_steps`` each, which only a very short run reaches)."""
    if train["lr"] != "auto":
        return 0.0
    search = train["lr_search"]
    return len(search["candidates"]) * search["probe_fraction"]


def _bench_row(config: dict, measured: dict, kind: str) -> dict:
    """The benchmark is closed-loop windows of fixed length: one per configuration (the target
    alone, each draft length, drafting greedily and probabilistically, each draft variant
    and each further draft), level, temperature (a probabilistic one only above 0) and
    repetition, plus a server start per configuration. Its levels are ``bench.levels`` or the
    defaults up to the concurrency generation uses (the measured profile's choice under
    ``auto``; else the profile's highest level, assumed)."""
    from draftline.stages import bench_drafts, bench_variants
    from draftline.stages.bench import configurations, default_levels

    bench, generate = config["bench"], config["generate"]
    configs = configurations(bench["num_speculative_tokens"],
                             tuple(bench["draft_sample_methods"]))
    configs += bench_drafts.configurations(bench["compare_drafts"],
                                           bench["num_speculative_tokens"])
    configs += bench_variants.configurations(variants.variant_names(config["train"]),
                                             bench["num_speculative_tokens"])
    if bench["levels"]:
        levels, basis = list(bench["levels"]), "bench.levels"
    elif isinstance(generate["concurrency"], int):
        levels, basis = default_levels(generate["concurrency"]), "up to generate.concurrency"
    elif (measured.get("profile") or {}).get("chosen_concurrency"):
        chosen = measured["profile"]["chosen_concurrency"]
        levels, basis = default_levels(chosen), "up to the profiled concurrency"
    else:
        levels = default_levels(max(config["profile"]["levels"]))
        basis = "up to the profile's highest level (assumed)"
    temperatures = bench["temperatures"] or sorted({0.0, float(generate["temperature"])})
    cells = sum(len([t for t in temperatures if t > 0 or "draft_sample_method" not in c])
                for c in configs)
    windows = cells * len(levels) * bench["repetitions"]
    window_s = bench["warmup_s"] + bench["measure_s"]
    start, start_basis = server_start(measured, kind)
    return _row("bench", 1_000_000, windows * window_s + len(configs) * start,
                f"{windows} windows ({cells} configuration-temperatures of {len(configs)} "
                f"configurations x {len(levels)} levels {basis} x {bench['repetitions']} "
                f"repetitions) x ({bench['warmup_s']} + {bench['measure_s']}) s + "
                f"{len(configs)} server starts x {start:.0f} s ({start_basis})")


def _total_row(config: dict, rows: list[dict]) -> dict:
    disk = sum(r["disk_bytes"] or 0 for r in rows)
    seconds = sum(r["time_s"] or 0 for r in rows)
    free, free_basis = free_disk(config)
    margin = config["hidden"]["disk_margin"]
    fits = free is None or disk * margin <= free
    verdict = "fits" if fits else "DOES NOT FIT"
    return _row("total", disk, seconds,
                f"{verdict}: {_bytes(disk * margin)} with margin {margin} vs "
                f"{_bytes(free)} {free_basis}", free_bytes=free, fits=fits)


# ----------------------------------------------------------------------------- output


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:,.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def format_plan(rows: list[dict]) -> str:
    """A fixed-width table: stage, disk, time, and what each figure is based on."""
    width = max(9, *(len(row["stage"]) for row in rows))  # variants: "train {name}"
    lines = [f"{'stage':<{width}} {'disk':>10} {'time':>9}  basis", "-" * 100]
    for row in rows:
        if row["stage"] == "total":
            lines.append("-" * 100)
        lines.append(f"{row['stage']:<{width}} {_bytes(row['disk_bytes']):>10} "
                     f"{_duration(row['time_s']):>9}  {row['basis']}")
    hidden = next((r for r in rows if r["stage"] == "hidden" and "bytes_per_token" in r), None)
    if hidden:
        lines.append(f"hidden states: {hidden['state_bytes_per_token']:,} B/token of states "
                     f"({hidden['state_bytes_per_token'] / 1024:,.1f} KiB), "
                     f"{hidden['bytes_per_token']:,} B/token stored")
    modes = rows[-1].get("modes")
    if modes:
        off, on = modes["offline"], modes["online"]
        lines.append(f"hidden.mode offline: peak disk {_bytes(off['peak_disk_bytes'])} of "
                     f"states, extraction + training {_duration(off['time_s'])} (states "
                     "extracted once)")
        held = (f"{_bytes(on['peak_disk_bytes'])} (the vllm producer's spool)"
                if on["peak_disk_bytes"] else f"0 (at most {_bytes(on['buffer_bytes'])} buffered)")
        lines.append(f"hidden.mode online:  peak disk {held}, training "
                     f"{_duration(on['time_s'])} (states produced {on['extractions']:g}x over "
                     f"{on['epochs']} epochs, {on['cached_share']:.0%} kept in memory "
                     f"between epochs: {_duration(on['produce_s'])})")
    return "\n".join(lines)


def production_example() -> tuple[dict, dict]:
    """The production case of docs/production.md as (config, measured): Kimi-K2.5 on 8 GPUs."""
    from draftline.core.config import validate_config

    config = validate_config({
        "target": {"model": "moonshotai/Kimi-K2.5", "trust_remote_code": True},
        "server": {"tensor_parallel_size": 8, "reasoning_parser": "kimi_k2"},
        "prompts": {"max_samples": 10_000},
        "generate": {"max_tokens": 2048},
        "dataset": {"max_length": 4096},
        "vocab": {"draft_vocab_size": 32_000},
        "hidden": {"backend": "vllm"},
    })
    # docs/production.md: ~1,536 output tok/s at C=128 on 8x RTX PRO 6000, the plateau of the curve
    measured = {"profile": {"chosen_concurrency": 128, "chosen_output_tok_s": 1536.0,
                            "peak": {"concurrency": 128, "output_tok_s": 1536.0}}}
    return config, measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.plan", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--config", "-c", nargs="+", default=["config/config.yaml"],
                        metavar="FILE", help="YAML config files, read in order")
    parser.add_argument("--production", action="store_true",
                        help="plan the production case (Kimi-K2.5, 10,000 samples)")
    args = parser.parse_args(argv)
    if args.production:
        config, measured = production_example()
    else:
        from draftline.core.config import load_config

        config = load_config(args.config)
        measured = measured_from_results(config)
    print(format_plan(plan(config, measured)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
