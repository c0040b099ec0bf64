"""What a run writes besides checkpoints: config.yaml, metrics.jsonl and the console lines;
the model FLOPs formula and the CPU's measured matmul rate for MFU."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def model_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token of the model config `m` (train.ModelConfig): 2 per multiply-add
    of every matmul in the forward pass, times 3 for forward + backward (the backward does two
    matmuls per forward matmul). Attention counts QK^T and PV over the causal half of the
    L x L scores. Norms, RoPE, softmax and the optimizer are left out (well under 1%)."""
    M, Q, K, D, F, V = m.d_model, m.n_q_per_kv, m.n_kv, m.d_head, m.d_ff, m.vocab
    projections = 2 * M * Q * K * D + 2 * (2 * M * K * D) + 2 * Q * K * D * M  # q, k and v, out
    ffn = 3 * (2 * M * F)  # gate, up, down
    attention = 2 * (2 * Q * K * D * seq_len) / 2  # QK^T and PV, causal half
    forward = m.layers * (projections + ffn + attention) + 2 * M * V  # + unembedding
    return 3.0 * forward


def measure_cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """The bf16 x bf16 -> f32 matmul rate of the whole machine (FLOP/s, median), the
    denominator of CPU MFU: every local device multiplies its own n x n matrices at once, as in
    training, so simulated devices that share cores are measured sharing them."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
    a = jax.device_put(jnp.ones((len(devices) * n, n), jnp.bfloat16), sharding)
    matmul = jax.shard_map(lambda x: jnp.matmul(x, x[:n].T, preferred_element_type=jnp.float32), mesh=mesh,
                           in_specs=jax.sharding.PartitionSpec("all"), out_specs=jax.sharding.PartitionSpec("all"))
    f = jax.jit(matmul)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return len(devices) * 2 * n**3 / float(np.median(times))


class RunLog:
    """One line per step to stdout and to <run_dir>/metrics.jsonl (appended on resume)."""

    def __init__(self, run_dir: str, resolved_yaml: str, tokens_per_step: int):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(resolved_yaml)
        self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.tokens_per_step = tokens_per_step
        self.last_time = time.perf_counter()

    def step(self, step: int, metrics):
        """Reads the step's scalars (waiting for that step only) and writes its line."""
        values = {k: float(v) for k, v in jax.device_get(vars(metrics)).items()}
        now = time.perf_counter()
        step_time, self.last_time = now - self.last_time, now
        line = {"step": step, **values, "step_time": step_time, "tokens_per_second": self.tokens_per_step / step_time}
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()
        print(f"step {step:6d}  loss {values['loss']:.4f}  lr {values['learning_rate']:.3g}  grad_norm {values['grad_norm']:.3g}  "
              f"{step_time * 1000:.0f} ms  {line['tokens_per_second']:.0f} tok/s", flush=True)

    def close(self):
        self.metrics_file.close()
