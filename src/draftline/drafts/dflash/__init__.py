"""The DFlash family (block-diffusion drafting, arXiv 2602.06036; ``drafting: dflash``).

Reading order: ``family`` (its facts for the registry, standard library only), ``config``
(``DFlashConfig``), ``model`` (the attention, the layer, the draft), ``train`` (anchors, the
block objective, the training hooks), ``export`` (vLLM's checkpoint).

A DFlash draft proposes a whole block of tokens in one forward pass. Its inputs are the
target's captured states of every accepted position (the context) and one block: the last
accepted token followed by mask tokens. Every block token attends to the whole context and to
the whole block (no causal mask inside the block), so one pass fills every mask slot.

Layout and names follow vLLM's ``DFlashQwen3ForCausalLM`` (``qwen3_dflash.py``, served with
``"method": "dflash"``) so that the state dict exports without renaming (``fc``,
``hidden_norm``, ``layers.{i}.*``, ``norm``); the embedding and lm_head are the target's:

    ctx    = hidden_norm(fc(aux))                 aux = the captured target layers, concatenated
    x      = embed([x_a, MASK, ..., MASK])        one block of B tokens at positions a..a+B-1
    for each layer (Qwen3, pre-norm):
        h  = input_layernorm(x)
        q  = rope(q_norm(q_proj(h)))                               per head
        k  = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(h)))]   the context, then the block
        v  = [v_proj(ctx) ; v_proj(h)]
        x  = x + o_proj(attention(q, k, v))       the block sees context positions < a, and itself
        x  = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                     the target's lm_head, its full vocabulary

The context never passes through a layer's input norm or MLP: every layer projects the same
``ctx`` with its own ``k_proj``/``v_proj``. Its layers share one ``k_norm`` (exported under
every layer's name): vLLM norms all layers' context keys in one grouped RMSNorm whose CPU
kernel reads only the first layer's weight (tests/test_dflash.py), so a draft with one k_norm
is served the same by vLLM's CPU and GPU builds, and the toy's benchmark measures the draft
that was trained. Slot j >= 1 of a block anchored at a
predicts the token at a + j; vLLM serves ``num_speculative_tokens`` = B - 1 (the bonus token
then B - 1 masks).

Training (the paper's objective): for each sample, anchors a are drawn among the generated
positions (``train.anchors`` per sample and step; evaluation takes every one). Each anchor is one
block ``[x_a, MASK, ...]`` that sees the target's states of positions < a, as the server's
draft sees the accepted context. Slot j learns the target's distribution of the token at a + j
(``train.loss``, at ``train.teacher_temperature``), over slots whose token is a generated one,
each slot weighed by the expected accepted run it opens (``train.slot_weights``; the paper's
fixed exp(-(j-1)/gamma) is ``decay``). All of a sample's blocks run in one pass: the
attention below scores each block against the context ``[A, B, S]`` and against its own block
``[A, B, B]``, never against the other blocks.

Shape legend: Bs samples, S tokens (padded), A anchors (blocks) per sample, B block size, H
hidden (the target's: the embedding and lm_head are shared), Ht target hidden, n captured
layers, V vocab, nh / nkv heads, hd head dim, L layers, K = B - 1 draft slots.
"""
