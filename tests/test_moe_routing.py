"""The router's routing returns through the forward (`GPT.forward(..., return_routing=True)`), not module state:
the logits are those of the plain forward, one `Routing` per MoE layer in layer order, differentiable to the
routers; the torch.compile'd blocks (`Runtime.compile_blocks`, aot_eager) return the same routing; the training
loop's `RoutedModel` keeps the forward with gradient (not DPO's no-grad reference forward). The recipes' losses with
the router loss: tests/test_moe_training.py; scanned and checkpointed on XLA: tests/xla/test_scan.py and
tests/xla/test_xla_moe.py."""

import pytest
import torch
import torch.nn.functional as F

from lit_gpt import GPT, Config
from lit_gpt.losses import MoETerms, RoutedModel
from lit_gpt.moe import MoE, load_balancing_loss


def moe_model() -> GPT:
    torch.manual_seed(0)
    # Qwen3-MoE's layout: a dense first layer, then MoE layers; no capacity, so that every dispatch is exact
    config = Config(vocab_size=64, n_layer=3, n_head=2, n_embd=16, block_size=32,
                    n_expert=4, n_expert_per_token=2, moe_intermediate_size=8, mlp_class_name="LLaMAMLP",
                    intermediate_size=32, norm_class_name="RMSNorm", moe_capacity_factor=None,
                    moe_dense_layers=[0], router_aux_loss_coef=0.1)
    model = GPT(config)
    model.apply(model._init_weights)
    return model.train()


def test_forward_returns_the_routing_and_the_modules_keep_none():
    model = moe_model()
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, routing = model(idx, return_routing=True)
    torch.testing.assert_close(logits, model(idx), rtol=0, atol=0)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(routing) == len(layers) == 2  # the MoE layers 1 and 2, in order
    for layer, r in zip(layers, routing):
        assert r.probs.shape == (16, 4) and r.experts.shape == (16, 2) and r.kept is None
        torch.testing.assert_close(r.probs.sum(-1), torch.ones(16))  # softmax over all experts
        assert (r.experts[:, 0] == r.probs.argmax(-1)).all()  # the first choice is the most probable expert
        assert not hasattr(layer, "routing")  # no side state left on the module
    aux = load_balancing_loss(routing)
    aux.backward()
    assert all(layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0 for layer in layers)
    # a dense model returns an empty routing
    dense = GPT(Config(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=32))
    assert dense(idx, return_routing=True)[1] == ()


@pytest.mark.slow  # dynamo traces 3 block graphs (forward and backward): ~15 s of CPU, ~50 s on a loaded machine
def test_compiled_blocks_return_the_eager_routing():
    from lit_gpt.runtime import Runtime

    torch._dynamo.reset()
    model, reference = moe_model(), moe_model()
    runtime = Runtime(device=torch.device("cpu"))
    runtime.compile_backend = "aot_eager"  # dynamo's capture without Inductor's C++ code generation (tens of s)
    runtime.compile_blocks(model)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, m in (("compiled", model), ("eager", reference)):
        logits, routing = m(idx, return_routing=True)
        aux = load_balancing_loss(routing)
        (F.cross_entropy(logits.flatten(0, 1), idx.flatten()) + aux).backward()
        out[name] = logits.detach(), [r.experts for r in routing], aux.detach(), \
            m.transformer.h[2].mlp.router.weight.grad.clone()
    (lc, ec, ac, gc), (le, ee, ae, ge) = out["compiled"], out["eager"]
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ec, ee))
    torch.testing.assert_close(ac, ae, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)


def test_routed_model_keeps_the_forward_with_gradient():
    model = moe_model()
    terms = MoETerms.of(model, accum=1, zeros=torch.zeros)
    routed = terms.forward
    assert isinstance(routed, RoutedModel) and model in list(routed.modules())  # adapters_disabled sees the model
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(routed(idx), model(idx), rtol=0, atol=0)
    with torch.no_grad():  # DPO's reference forward: its routing is not the one the loss differentiates
        routed(idx.flip(0))
    routing = routed.take()
    assert len(routing) == 2 and routing[0].probs.requires_grad
    assert torch.equal(routing[0].experts, model(idx, return_routing=True)[1][0].experts)
    assert routed.take() == ()  # taken once
    aux = terms.micro_batch(torch.ones(2, 8, dtype=torch.bool), routing)
    torch.testing.assert_close(aux, 0.1 * load_balancing_loss(routing))
    routed(idx)  # the loop's way: the micro-batch takes what the forward returned
    torch.testing.assert_close(terms.micro_batch(torch.ones(2, 8, dtype=torch.bool)), aux)
    assert terms.micro_batch(torch.ones(2, 8, dtype=torch.bool)) is None  # nothing since
