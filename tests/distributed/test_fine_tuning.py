"""Fine-tuning, alone and under the launcher: only the trainable parameters (LoRA adapters)
are broadcast, checkpointed and written as an adapters file; the frozen base never travels."""

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du


class Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter, as LoRA does."""

    def __init__(self, seed):
        super().__init__()
        mx.random.seed(seed)
        self.base = nn.Linear(6, 4)
        self.lora_a = mx.random.normal((6, 2)) * 0.1
        self.lora_b = mx.random.normal((2, 4)) * 0.1
        self.base.freeze()

    def __call__(self, x):
        return self.base(x) + (x @ self.lora_a) @ self.lora_b


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def batches(rank, steps):
    rng = np.random.default_rng(100 + rank)
    return [
        (
            mx.array(rng.standard_normal((5, 6)).astype(np.float32)),
            mx.array(rng.standard_normal((5, 4)).astype(np.float32)),
        )
        for _ in range(steps)
    ]


def train(backend, model, opt, data):
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    for x, y in data:
        opt.update(model, loss_and_grad(model, x, y)[1])
        mx.eval(model.parameters(), opt.state)


def same_base_model(backend):
    """Every rank loads the same base (seed 0) and initializes its adapters at random."""
    model = Adapted(0)
    mx.random.seed(1 + du.local_rank(backend))
    model.lora_a, model.lora_b = mx.random.normal((6, 2)) * 0.1, mx.random.normal((2, 4)) * 0.1
    return model


def test_synchronize_trainable_only_sends_the_adapters_alone(backend):
    model = Adapted(du.local_rank(backend))  # a different base on every rank, to see what travels
    base = np.array(model.base.weight)
    du.synchronize(backend, model, trainable_only=True)
    assert np.array_equal(np.array(model.base.weight), base)  # not broadcast
    for key, a in tree_flatten(model.trainable_parameters()):
        assert mx.array_equal(a, du.bcast(backend, a)).item(), key  # root's adapters everywhere


def test_a_trainable_only_checkpoint_holds_the_adapters_and_resumes_exactly(backend, tmp_path):
    path = du.bcast(backend, str(tmp_path / "ck.safetensors"))
    rank = du.local_rank(backend)
    data = batches(rank, 4)
    whole = same_base_model(backend)
    du.synchronize(backend, whole, trainable_only=True)
    train(backend, whole, du.DistributedOptimizer(backend, optim.Adam(1e-2)), data)

    model, opt = same_base_model(backend), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    du.synchronize(backend, model, trainable_only=True)
    train(backend, model, opt, data[:2])
    du.save_checkpoint(backend, path, model=model, optimizer=opt, step=2, trainable_only=True)
    if rank == 0:
        saved = {k for k in mx.load(path) if k.startswith("model.")}
        assert saved == {"model.lora_a", "model.lora_b"}  # no frozen base

    resumed, again = same_base_model(backend), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    assert du.load_checkpoint(backend, path, model=resumed, optimizer=again)["step"] == 2
    train(backend, resumed, again, data[2:])
    for (key, a), (_, b) in zip(tree_flatten(whole.parameters()), tree_flatten(resumed.parameters())):
        assert mx.array_equal(a, b).item(), key


def test_an_adapters_file_is_what_mlx_and_mlx_lm_read(backend, tmp_path):
    folder = du.bcast(backend, str(tmp_path / "adapters"))
    model = same_base_model(backend)
    du.synchronize(backend, model, trainable_only=True)
    config = {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 2, "scale": 1.0}}
    du.save_adapters(backend, f"{folder}/adapters.safetensors", model, config=config)
    if du.local_rank(backend) == 0:
        loaded = mx.load(f"{folder}/adapters.safetensors")
        assert set(loaded) == {"lora_a", "lora_b"}
        assert json.loads(open(f"{folder}/adapter_config.json").read()) == config
        fresh = Adapted(0)
        fresh.load_weights(f"{folder}/adapters.safetensors", strict=False)  # as mlx-lm's load_adapters
        assert (
            mx.array_equal(fresh.lora_a, model.lora_a).item()
            and mx.array_equal(fresh.lora_b, model.lora_b).item()
        )
