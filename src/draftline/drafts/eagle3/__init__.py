"""The EAGLE-3 family: EAGLE-3, EAGLE-3.1 (``fc_norm``, ``norm_output``), the MLA draft
(``arch: deepseek_mla``) and P-EAGLE (``drafting: parallel``), one unrolled layer each.

Reading order: ``family`` (its facts for the registry, standard library only), ``config``
(``DraftConfig``), ``model`` (the attention, the layer, the draft), ``train`` (the TTT loss and
the training hooks), ``export`` (vLLM's checkpoint). The shared pieces are one folder up:
``draftline.drafts.layers`` (norms, rotary), ``draftline.drafts.ttt`` (the TTT attention),
``draftline.drafts.teacher``, ``draftline.drafts.losses`` and ``draftline.drafts.acceptance``.

Layout and names follow vLLM's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) so that the
state dict exports without renaming (``fc``, ``midlayer.*``, ``norm``, ``lm_head``):

    h0     = fc(aux)                                   aux = 3 target layers, concatenated
    x      = [input_layernorm(embed(token)), hidden_norm(h)]       -> attention input (2H)
    r      = h + self_attn(x)                          residual is the un-normed state h
    h_next = r + mlp(post_attention_layernorm(r))      "prenorm" state, fed to the next step
    logits = lm_head(norm(h_next))                     over the draft vocab

Four flags of vLLM's ``Eagle3LlamaForCausalLM`` change where norms sit (``DraftConfig``; the
exported config.json carries them): ``norm_before_fc`` normalises the concatenated aux states
before ``fc`` (``input_norm``, [A]); ``fc_norm`` (EAGLE-3.1) normalises each aux state on its
own (``fc_norm.{i}``, after ``input_norm`` where both are set); ``norm_before_residual``
makes the residual the normed state, r = hidden_norm(h) + self_attn(x); ``norm_output``
(EAGLE-3.1) feeds the next step norm(h_next) instead of the prenorm state.

Alignment (as vLLM's EAGLE proposer): row i of step 0 holds the target state at position i and
the token at i+1, sits at rotary position i, and predicts token i+2. Step k feeds row i its
own step k-1 state, the token at i+1+k, at rotary position i+k, and predicts token i+2+k.

The MLA draft (``arch`` "deepseek_mla"; vLLM's ``Eagle3DeepseekV3ForCausalLM``) is the same
layer with DeepSeek's multi-head latent attention in place of the Llama one (``DraftMLA``):
queries through a low-rank ``q_a_proj``/``q_b_proj``, keys and values from one compressed
latent (``kv_a_proj_with_mqa``, ``kv_b_proj``) plus a rotary part shared by all heads, rotated
GPT-J style (interleaved pairs) with DeepSeek's YaRN. It has no ``norm_before_fc``.

Parallel drafting (P-EAGLE, ``parallel_drafting``; vLLM's ``parallel_drafting`` speculative
setting): vLLM drafts all K tokens in one forward pass, appending K-1 mask slots after the last
real token, each with the token ``mask_token_id`` and the state ``fc(mask_hidden)`` (a trained
``[A]`` vector, combined like the aux states). Training is the same unroll with those constant
inputs at steps k >= 1: step k of row i is the mask slot at position i+k, and the TTT
attention below is exactly the causal attention of that appended sequence.

Attention at step k (``draftline.drafts.ttt``): row i sees the step-0 keys/values of rows
j <= i (the real context, as in vLLM's draft KV cache) plus its own keys/values of steps 1..k
(a diagonal), softmaxed jointly, never as a dense [T, T*K] mask.

Samples are not packed into one row: a batch is ``[B, T]`` with each sample in its own row,
right-padded. Causal masking then keeps attention inside a sample (padding comes after the
real tokens, so no real row can see it) without any block-diagonal mask.

Shape legend: B samples, T tokens (padded), H draft hidden, Ht target hidden, A = 3*Ht aux
width, D draft vocab, V target vocab, K unroll steps, nh / nkv heads, hd head dim.
"""
