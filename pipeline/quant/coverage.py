"""Calibration coverage per expert: how many calibration tokens each Mixture-of-Experts layer routed to each of its
experts, measured on the run's calibration rows through the baseline model.

Pure core: `expert_token_counts(top_k_index, num_experts)` (the top-k expert indices a block chose -> tokens per
expert) and `top_k_counts(router_logits, top_k)` (softmax-then-top-k routers, for tests and tools).
Thin wrapper: `measure(model, ids, arch)` hooks the experts module of every MoE layer and counts what it was given.

Where the indices come from: every MoE block of transformers 5.24 (qwen3_moe, mixtral, olmoe, granitemoe, gpt_oss,
deepseek_v3) computes its routing (softmax-then-top-k, top-k-then-softmax, DeepSeek's grouped choice with a score
bias) and then calls its experts module as `experts(hidden_states, top_k_index, top_k_weights)`. A forward pre-hook
on the experts module reads the indices the block actually used, so no router's selection is restated here. Each
token counts once for each expert it was routed to: a layer's counts sum to tokens x top_k.
"""
from __future__ import annotations

import inspect
from contextlib import ExitStack

import torch

from pipeline.base.errors import StageError
from pipeline.model.architecture import EXPERT, Architecture

# the experts module's argument that holds the chosen expert indices, by the names transformers 5.24 uses
INDEX_ARGS = ("top_k_index", "router_indices", "topk_indices", "selected_experts")


def expert_token_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., top_k] expert indices -> [num_experts] int64 counts: how many (token, slot) pairs chose each expert.
    Indices outside 0..num_experts-1 (transformers' expert-parallel mask uses num_experts) are not counted."""
    idx = top_k_index.reshape(-1).to(torch.int64)
    idx = idx[(idx >= 0) & (idx < num_experts)]
    return torch.bincount(idx, minlength=num_experts)


def top_k_counts(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[tokens, num_experts] router logits of a softmax-then-top-k router (Qwen3-MoE, Mixtral, OLMoE) -> counts.
    Softmax is monotone, so its top-k are the logits' top-k."""
    return expert_token_counts(torch.topk(router_logits, top_k, dim=-1).indices, router_logits.shape[-1])


def experts_modules(model: torch.nn.Module, arch: Architecture) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its routed experts module} for every MoE layer, located by the architecture's own
    description (pipeline/model/architecture.py: "mlp.experts.#.gate_proj" -> "mlp.experts")."""
    e = arch.experts
    if e is None:
        return {}
    path = e.linears[0].split(f".{EXPERT}.")[0] if e.linears else f"{e.block}.experts"
    layers: list[torch.nn.Module] = list(model.get_submodule(arch.layers).children())
    out = {}
    for i, layer in enumerate(layers):
        if i in e.dense_layers:
            continue
        try:
            out[i] = layer.get_submodule(path)
        except AttributeError:
            raise StageError(f"calibration coverage: layer {i} of {arch.model_type} has no experts module {path!r} "
                             f"({arch.definition})") from None
    return out


def _index_arg(module: torch.nn.Module):
    """A function (args, kwargs) -> the top-k index tensor the experts module was called with."""
    params = list(inspect.signature(module.forward).parameters)
    name = next((p for p in params if p in INDEX_ARGS), None)
    if name is None:
        raise StageError(f"calibration coverage: {type(module).__name__}.forward{tuple(params)} takes no top-k "
                         f"expert indices (one of {INDEX_ARGS}): cannot count the tokens routed to its experts")
    pos = params.index(name)

    def read(args: tuple, kwargs: dict) -> torch.Tensor:
        return kwargs[name] if name in kwargs else args[pos]
    return read


@torch.inference_mode()
def measure(model: torch.nn.Module, ids: torch.Tensor, arch: Architecture, batch_rows: int = 1) -> dict:
    """Run the calibration rows [n, seq_len] through `model` and count, per MoE layer, the tokens routed to each
    expert. The coverage record (pipeline/results/schema.py ExpertCoverage)."""
    assert arch.experts is not None
    n_exp = arch.experts.count
    modules = experts_modules(model, arch)
    counts = {i: torch.zeros(n_exp, dtype=torch.int64) for i in modules}
    calls = dict.fromkeys(modules, 0)

    def hook(i: int, read):
        def pre(module, args, kwargs):
            counts[i] += expert_token_counts(read(args, kwargs).detach().cpu(), n_exp)
            calls[i] += 1
        return pre

    device = next(model.parameters()).device
    with ExitStack() as stack:
        for i, m in modules.items():
            stack.callback(m.register_forward_pre_hook(hook(i, _index_arg(m)), with_kwargs=True).remove)
        for start in range(0, ids.shape[0], batch_rows):
            model(input_ids=ids[start:start + batch_rows].to(device), use_cache=False)
    silent = [i for i, c in calls.items() if not c]
    if silent:  # a fused kernel replaced the block's forward: the counts would read as zero tokens
        raise StageError(f"calibration coverage: the experts module of layer(s) {silent} never ran during the forward "
                         "pass (is a fused MoE kernel replacing the block?): cannot count their tokens")
    return {"tokens": int(ids.numel()), "num_experts": n_exp, "top_k": arch.experts.top_k,
            "layers": list(counts), "counts": [counts[i].tolist() for i in counts]}
