"""The model card's HTML: other stages' Markdown (the benchmark summary) rendered as HTML,
tables as tables."""

from __future__ import annotations

from html.parser import HTMLParser

from draftline.stages.modelcard import Card, Heading, Markdown, Para, render_html

SUMMARY = """# Deployment benchmark: baseline vs the draft

closed-loop windows of 3 s; `running` is the server's mean running requests,
`*` marks a cell below 0.9 x C.

| config | T | C | output tok/s | note |
|---|---|---|---|---|
| baseline | 0 | 1 | 226.0 (212.6-236.6) | a \\| b |
| eagle3-k3 | 0 | 1 | 120.0 (117.0-120.7) | - |

**eagle3-k3 is slower than the baseline here:** below break-even.

- one
- two

```bash
vllm serve x
```
"""


class Tables(HTMLParser):
    """The text of every table cell, per table, per row; and the text inside <pre>."""

    def __init__(self):
        super().__init__()
        self.tables, self.pre, self._cell, self._in_pre = [], [], None, False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "pre":
            self._in_pre = True
            self.pre.append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None
        elif tag == "pre":
            self._in_pre = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._in_pre:
            self.pre[-1] += data


def test_markdown_from_another_stage_renders_as_html_tables_and_text():
    card = Card({}, [Heading(1, "card"), Para("served with `vllm`"), Markdown(SUMMARY)])
    page = render_html(card, root=".")
    parsed = Tables()
    parsed.feed(page)
    assert parsed.tables == [[
        ["config", "T", "C", "output tok/s", "note"],
        ["baseline", "0", "1", "226.0 (212.6-236.6)", "a | b"],
        ["eagle3-k3", "0", "1", "120.0 (117.0-120.7)", "-"],
    ]]
    assert parsed.pre == ["vllm serve x"]  # only the code block stays preformatted
    assert "|---|" not in page
    assert "<h1>Deployment benchmark: baseline vs the draft</h1>" in page
    assert "<code>running</code> is the server&#x27;s mean running requests, <code>*</code>" in page
    assert "<strong>eagle3-k3 is slower than the baseline here:</strong>" in page
    assert "<ul><li>one</li><li>two</li></ul>" in page
    assert "<p>served with <code>vllm</code></p>" in page


def test_sglang_layer_ids_capture_the_states_vllm_captures():
    """Both servers' capture rules, as their sources state them, on one layer stack: the
    residual stream entering layer i is ``stream[i]`` (stream[0] the embeddings).

    vLLM (EAGLE-3 aux ids): id k captures the stream entering layer k. SGLang
    (python/sglang/srt/models/llama.py): ``layers_to_capture = [val + 1 for val in
    layer_ids]``, and the layer loop appends ``hidden_states + residual`` before running layer
    i for i in layers_to_capture."""
    from draftline.stages.modelcard import sglang_layer_ids

    num_layers = 8
    stream = [f"entering layer {i}" for i in range(num_layers)]

    def vllm_captures(ids):
        return [stream[i] for i in range(num_layers) if i in ids]

    def sglang_captures(ids):
        layers_to_capture = [val + 1 for val in ids]
        return [stream[i] for i in range(num_layers) if i in layers_to_capture]

    for vllm_ids in ([2, 4, 5], [1, 3, 6], [2, 30 % num_layers, 7]):
        assert sglang_captures(sglang_layer_ids(vllm_ids)) == vllm_captures(vllm_ids)
        assert sglang_captures(vllm_ids) != vllm_captures(vllm_ids)  # the same ids would not
    assert sglang_layer_ids([2, 30, 58]) == [1, 29, 57]  # the published Kimi drafts' ids


def test_the_card_names_the_benchmark_cells_that_could_not_be_measured():
    from draftline.stages.modelcard import _benchmark, render_markdown

    reason = "only 0 of the 2 requests a C=1 window needs finished"
    card = Card({})
    _benchmark(card, {"bench_summary": SUMMARY, "bench_results": {"unmeasured": [
        {"config": "baseline", "temperature": 0.0, "concurrency": 1, "reason": reason}]}})
    text = render_markdown(card)
    assert "1 benchmark cell(s) could not be measured" in text
    assert f"| baseline | 0 | 1 | {reason} |" in text
    card = Card({})
    _benchmark(card, {"bench_summary": SUMMARY, "bench_results": {"unmeasured": []}})
    assert "could not be measured" not in render_markdown(card)
