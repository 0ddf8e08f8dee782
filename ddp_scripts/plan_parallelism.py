"""Lesson 13: which parallelism? A planner for memory, communication and time, per strategy.

    python plan_parallelism.py --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 4096 \\
        --nodes 8 --gpus-per-node 8 --gpu-memory-gb 80 --tflops 400 --inter-gbps 400

For a decoder (its layers, hidden size, heads, vocabulary, sequence length) or any torch.nn.Module
(Model.from_module, built on the meta device), an optimizer, a precision, a micro-batch and a global
batch, and a cluster (GPUs per node, nodes, memory and achieved FLOP/s per GPU, each link's latency
and bandwidth), it prints for each strategy what one GPU holds (parameters, gradients, optimizer
state, activations), what it sends in a step and how long that takes, how long it computes, whether
it fits, and ranks those that fit by their predicted step.

The arithmetic, each piece a function below, each checked in tests/unit/test_plan_parallelism.py:
  bytes per parameter    fp32: 4 + 4 + optimizer (SGD 0, momentum 4, Adam 8); 16-bit mixed: 2 + 2 +
                         (fp32 master copy 4 + SGD 0, momentum 4, Adam 8): Adam's 16 (ZeRO's K = 12)
  sharding               ZeRO-1 the optimizer state, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the
                         parameters too, over the data-parallel ranks; HSDP within a node, replicated
                         across nodes; torch's ZeRO-1 deals whole tensors, largest first (deal())
  activations            a decoder layer keeps s b h (34 + 5 a s / h) bytes in 16 bits (Korthikanti et
                         al., 2022), with tensor parallelism t: s b h (10 + 24 / t + 5 a s / (h t));
                         the 5 a s / h term is the attention scores, which FlashAttention does not
                         keep; recomputed: its input, 2 s b h, plus one layer's while it recomputes
  communication          comm_bytes.bytes_sent (the sharding lessons' formula) per collective, and
                         its time t = steps x alpha + bytes / bandwidth (lesson 9's fit), on the
                         slower link the group crosses
  compute                6 flops per parameter and token (forward 2, backward 4), + attention's
                         12 L s h per token; 8 with recomputation; pipeline: x (m + p - 1) / m
  pipeline               pipeline_step_s: m + p - 1 slots, each a micro-batch's work on a stage and its
                         messages; the bubble (p - 1) / (m + p - 1)
No overlap of communication with computation is assumed: the step is their sum, an upper bound
(DDP and FSDP overlap much of it). Mixed precision is counted as the ZeRO paper and DeepSpeed keep it
(16-bit parameters and gradients, the fp32 master copy in the optimizer's state); torch's autocast
under DDP keeps fp32 parameters and gradients (plan it as --precision fp32 for memory); Megatron-LM
keeps fp32 gradients besides: 2 more bytes a parameter. DDP accumulates with
no_sync() (one all-reduce a step); fully_shard reduce-scatters every micro-batch, and gathers each
layer while prefetching the next. Layout: tensor parallelism innermost, within a node; then
pipeline stages; then data parallelism across what is left.
"""
import math
import sys
from dataclasses import dataclass, field

try:  # the course's modules, written once: copy them beside this file
    from comm_bytes import bytes_sent
    from ddp_hardening import Parser, UsageError, positive
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")

GB = 1e9  # the ZeRO paper's GB, and the GPUs' "80 GB"
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # state per parameter, fp32
PRECISIONS = ("fp32", "bf16-mixed")


# --------------------------------------------------------------------------- the model
@dataclass
class Model:
    """What the planner needs of a model: its parameter tensors (name, elements), and, for a decoder,
    its shape (layers, hidden, heads, vocabulary, sequence), from which activations and flops follow.
    A module without that shape gives its activations and flops per sample, measured on the meta
    device (from_module)."""
    tensors: list
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    seq: int = 0
    activation_bytes_per_sample: float = 0.0  # a module's, fp32
    flops_per_sample: float = 0.0  # a module's, forward and backward

    @property
    def params(self):
        return sum(n for _, n in self.tensors)

    @property
    def is_decoder(self):
        return self.layers > 0

    @property
    def layer_params(self):
        """One decoder layer's parameters: attention 4 h^2 + 4 h, MLP 8 h^2 + 5 h, two norms 4 h."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @staticmethod
    def decoder(layers, hidden, heads, vocab, seq):
        """A GPT-style decoder: token and position embeddings, `layers` blocks (attention, an MLP of
        4 h, two layer norms), a final norm; the output layer shares the token embedding."""
        h, tensors = hidden, [("embed.tokens", vocab * hidden), ("embed.positions", seq * hidden)]
        for i in range(layers):
            tensors += [(f"{i}.attn.qkv.weight", 3 * h * h), (f"{i}.attn.qkv.bias", 3 * h),
                        (f"{i}.attn.proj.weight", h * h), (f"{i}.attn.proj.bias", h),
                        (f"{i}.mlp.up.weight", 4 * h * h), (f"{i}.mlp.up.bias", 4 * h),
                        (f"{i}.mlp.down.weight", 4 * h * h), (f"{i}.mlp.down.bias", h),
                        (f"{i}.norm1.weight", h), (f"{i}.norm1.bias", h),
                        (f"{i}.norm2.weight", h), (f"{i}.norm2.bias", h)]
        tensors += [("norm.weight", h), ("norm.bias", h)]
        return Model(tensors, layers, hidden, heads, vocab, seq)

    @staticmethod
    def from_module(module, example_input=None):
        """A module's parameters (a tensor shared by two layers counted once); with an example input
        (one sample's shape, a batch of 1), its forward run on the meta device, no memory used: what
        autograd keeps for backward (saved_tensors_hooks, the weights left out, as lesson 11 counts
        it) and its flops (FlopCounterMode; backward counted as twice the forward)."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        seen, tensors = set(), []
        for name, p in module.named_parameters():
            if p.device.type != "meta":
                raise ValueError("build the module on the meta device: with torch.device('meta'): ...")
            if id(p) not in seen:
                seen.add(id(p))
                tensors.append((name, p.numel()))
        model = Model(tensors)
        if example_input is not None:
            weights, saved = [p for p in module.parameters()], {}

            def pack(t):  # each tensor kept for backward, once; a weight (or a view of one) is no activation
                base = t if t._base is None else t._base
                if not any(base is w for w in weights):
                    saved[id(base)] = base.nbytes
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    FlopCounterMode(display=False) as counter:
                module(example_input.to("meta"))
            model.activation_bytes_per_sample = sum(saved.values()) / len(example_input)
            model.flops_per_sample = 3 * counter.get_total_flops() / len(example_input)
        return model


def deal(sizes, n):
    """torch's ZeroRedundancyOptimizer's dealing: each tensor whole, the largest first, to the rank with
    the fewest elements so far (the lowest on a tie). Returns each rank's elements."""
    elements = [0] * n
    for size in sorted(sizes, reverse=True):
        elements[elements.index(min(elements))] += size
    return elements


# --------------------------------------------------------------------------- the training
@dataclass
class Training:
    optimizer: str = "adam"  # sgd, momentum, adam (AdamW too)
    precision: str = "bf16-mixed"  # fp32, bf16-mixed (bf16 parameters and gradients, fp32 master)
    micro_batch: int = 1  # samples per GPU per forward
    global_batch: int = 1  # samples per step, all GPUs together
    recompute: bool = False  # full activation recomputation
    flash_attention: bool = True  # attention that keeps no s x s scores (FlashAttention, SDPA's kernels)

    @property
    def param_bytes(self):
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self):
        return self.param_bytes

    @property
    def optimizer_bytes(self):
        """The optimizer's state per parameter; in mixed precision with the fp32 master copy (ZeRO's K)."""
        return OPTIMIZER_BYTES[self.optimizer] + (0 if self.precision == "fp32" else 4)

    @property
    def activation_scale(self):  # the activation formula counts 16-bit values
        return 2.0 if self.precision == "fp32" else 1.0


@dataclass
class Link:
    latency_s: float  # alpha: one step of a ring
    bandwidth: float  # bytes per second, one way, per GPU


@dataclass
class Cluster:
    gpus_per_node: int = 8
    nodes: int = 1
    memory_bytes: float = 80 * GB
    flops: float = 400e12  # achieved per GPU, not the datasheet's peak
    intra: Link = field(default_factory=lambda: Link(5e-6, 150e9))  # NVLink-class
    inter: Link = field(default_factory=lambda: Link(10e-6, 50e9))  # 400 Gbit/s per GPU
    backend: str = "nccl"

    @property
    def gpus(self):
        return self.gpus_per_node * self.nodes


# --------------------------------------------------------------------------- one strategy
@dataclass
class Plan:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    memory: dict = field(default_factory=dict)  # kind -> bytes on the fullest GPU
    # (what, collective, bytes, group size, link, times a step, calls each time: each pays the latency)
    comm: list = field(default_factory=list)
    micro_batches: int = 1  # per GPU per step
    message_s: float = 0.0  # a pipeline's point-to-point message: an activation on, or a gradient back
    compute_s: float = 0.0  # per GPU, its micro-batches' forwards and backwards
    bubble: float = 0.0
    fits: bool = False
    problem: str = ""  # why it cannot run, if it cannot

    @property
    def memory_total(self):
        return sum(self.memory.values())

    def sent_bytes(self, backend="nccl"):
        return sum(times * bytes_sent(c, size, n, backend) for _, c, size, n, _, times, _ in self.comm)

    def collectives_s(self, cluster):
        return sum(times * collective_seconds(c, size, n, link, cluster.backend, calls)
                   for _, c, size, n, link, times, calls in self.comm if c != "send")

    def comm_s(self, cluster):
        """The collectives, and a pipeline's messages on its critical path: 2 (m + p - 1) of them."""
        path = 2 * (self.micro_batches + self.pp - 1) if self.pp > 1 else 0
        return self.collectives_s(cluster) + path * self.message_s

    def step_s(self, cluster):
        return pipeline_step_s(self.micro_batches, self.pp, self.compute_s, 2 * self.message_s) \
            + self.collectives_s(cluster)


def pipeline_step_s(m, p, whole_s, per_microbatch_s):
    """A pipeline's step, GPipe or 1F1B, on p equal stages (p = 1: no pipeline): m + p - 1 slots one
    after another, each a stage's work on one micro-batch, whole_s / m, plus what every micro-batch
    costs whatever its size: its two messages (the activation on, the gradient back) and, on a
    CPU, each micro-batch's own fixed costs (lesson 11 measures them). The bubble is in the slots:
    (p - 1) / (m + p - 1) of them idle on each stage."""
    return (m + p - 1) * (whole_s / m + per_microbatch_s)


def collective_seconds(collective, size, n, link, backend="nccl", calls=1):
    """alpha-beta, as lesson 9 fits it: a ring's steps (2 (n - 1) for an all-reduce, and for Gloo's
    reduce-scatter, which is one; n - 1 for an all-gather or NCCL's reduce-scatter; one for a
    point-to-point send) times the latency, plus the bytes each rank sends over the bandwidth. Split
    into `calls` collectives (DDP's buckets, FSDP's layers, ZeRO-1's tensors), each pays the latency."""
    if n <= 1 and collective != "send":
        return 0.0
    if collective == "send":
        return calls * link.latency_s + size / link.bandwidth
    whole_ring = collective == "all_reduce" or collective == "reduce_scatter" and backend == "gloo"
    steps = 2 * (n - 1) if whole_ring else n - 1
    return calls * steps * link.latency_s + bytes_sent(collective, size, n, backend) / link.bandwidth


def fit_pipeline(steps, p, fit_on):
    """pipeline_step_s's two unknowns, whole_s and per_microbatch_s, from the measured steps (seconds,
    by micro-batch count) at the two counts of fit_on: two linear equations, solved exactly."""
    (m1, m2) = fit_on
    a1, b1, a2, b2 = (m1 + p - 1) / m1, m1 + p - 1, (m2 + p - 1) / m2, m2 + p - 1
    det = a1 * b2 - a2 * b1
    return (steps[m1] * b2 - steps[m2] * b1) / det, (a1 * steps[m2] - a2 * steps[m1]) / det


def state_bytes(model, training, shard, n, dealing="even", params=None):
    """Parameters, gradients and optimizer state on one of n data-parallel ranks (the fullest).
    shard: 0 (DDP), 1 (ZeRO-1: the optimizer state), 2 (and the gradients), 3 (and the parameters).
    dealing: "even" (the ZeRO paper's Psi / N) or "torch" (ZeRO-1 dealt as torch deals, whole tensors);
    ZeRO-2 in fp32 keeps a copy of its rows to step, as DeepSpeed's does and the course's (in mixed
    precision that copy is the fp32 master, already in the optimizer's bytes); ZeRO-3 steps its shards."""
    psi = model.params if params is None else params
    p, g, o = training.param_bytes, training.grad_bytes, training.optimizer_bytes
    share = psi / n
    if shard == 1 and dealing == "torch":
        share = max(deal([size for _, size in model.tensors], n))
    memory = {"parameters": psi * p, "gradients": psi * g, "optimizer": psi * o}
    if shard >= 1:
        memory["optimizer"] = share * o
    if shard >= 2:
        memory["gradients"] = share * g
        if training.precision == "fp32" and shard == 2:
            memory["optimizer"] += share * p  # the rows' copy that the optimizer steps
    if shard >= 3:
        memory["parameters"] = share * p
    return memory


def activation_bytes(model, training, micro_batch, tp=1, layers=None, in_flight=1, logits=True):
    """What `in_flight` micro-batches leave for backward on one GPU: `layers` decoder layers (all by
    default) and the logits (fp32) when the last layer is here; recomputing, each layer's input, and
    one layer's activations while it is recomputed; a module: its measured bytes per sample."""
    if not model.is_decoder:
        return model.activation_bytes_per_sample * micro_batch * in_flight
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    layers = model.layers if layers is None else layers
    scores = 0 if training.flash_attention else 5 * a * s / (h * tp)
    per_layer = s * b * h * (10 + 24 / tp + scores) * training.activation_scale
    if training.recompute:
        kept = in_flight * layers * 2 * s * b * h * training.activation_scale + per_layer
    else:
        kept = in_flight * layers * per_layer
    return kept + (in_flight * 4 * s * b * model.vocab / tp if logits else 0)


def flops_per_sample(model, recompute=False):
    """Forward and backward (and a second forward when recomputing) of one sample."""
    if not model.is_decoder:
        return model.flops_per_sample * (4 / 3 if recompute else 1)
    per_token = 6 * model.params + 12 * model.layers * model.seq * model.hidden
    return per_token * model.seq * (8 / 6 if recompute else 1)


def where(group_size, stride, cluster):
    """The link a group of GPUs `stride` apart crosses: within a node if every such group fits in
    one (the node's GPUs a whole number of the groups' span), else between nodes."""
    return cluster.intra if cluster.gpus_per_node % (group_size * stride) == 0 else cluster.inter


def plan(name, model, training, cluster, shard=0, dp=None, tp=1, pp=1, hybrid=False, dealing="torch"):
    """One strategy: `shard` as in state_bytes over the dp ranks (hybrid: sharded within a node only,
    HSDP), tensor parallelism tp within a node, pp pipeline stages (1F1B)."""
    dp = cluster.gpus // (tp * pp) if dp is None else dp
    result = Plan(name, dp=dp, tp=tp, pp=pp)
    if dp * tp * pp != cluster.gpus:
        result.problem = f"{dp} x {tp} x {pp} is not the {cluster.gpus} GPUs"
    elif cluster.gpus_per_node % tp:
        result.problem = f"tensor parallelism over {tp} GPUs leaves a node of {cluster.gpus_per_node}"
    elif (tp > 1 or pp > 1) and not model.is_decoder:
        result.problem = "tensor and pipeline parallelism are planned for decoders only"
    elif tp > 1 and (model.heads % tp or model.hidden % tp):
        result.problem = f"{model.heads} heads do not split over {tp} GPUs"
    elif pp > 1 and model.layers % pp:
        result.problem = f"{model.layers} layers do not split into {pp} stages"
    elif training.global_batch % (training.micro_batch * dp):
        result.problem = (f"a global batch of {training.global_batch} is not a whole number of "
                          f"micro-batches of {training.micro_batch} on {dp} data-parallel GPUs")
    if result.problem:
        return result
    micro_batches = training.global_batch // (training.micro_batch * dp)  # per GPU per step
    result.micro_batches = micro_batches
    group = cluster.gpus_per_node // (tp * pp) if hybrid else dp  # the GPUs a shard spreads over
    if hybrid and (group < 2 or dp % group):
        result.problem = "HSDP needs a node of several data-parallel GPUs and several nodes"
        return result

    # What one GPU holds: the fullest stage (the first: its layers and the embeddings).
    if model.is_decoder:
        embed = (model.vocab + model.seq) * model.hidden
        params = model.layers // pp * model.layer_params / tp + embed / tp
        if pp == 1:
            params += 2 * model.hidden
        params = round(params)
    else:
        params = model.params
    result.memory = state_bytes(model, training, shard, group, dealing, params=params)
    # 1F1B: the first stage keeps pp micro-batches' activations; the logits are the last stage's
    result.memory["activations"] = activation_bytes(
        model, training, training.micro_batch, tp, layers=model.layers // pp if model.is_decoder else None,
        in_flight=min(pp, micro_batches), logits=pp == 1)
    if shard == 3:  # one layer gathered whole, the next one prefetched (fully_shard's), one layer's gradient
        layer = model.layer_params / tp if model.is_decoder else max(size for _, size in model.tensors)
        result.memory["gathered"] = layer * (2 * training.param_bytes + training.grad_bytes)
    result.fits = result.memory_total <= cluster.memory_bytes

    # What it sends in a step.
    p_bytes, g_bytes = params * training.param_bytes, params * training.grad_bytes
    dp_link = where(group if hybrid else dp, tp * pp, cluster)
    buckets = max(1, math.ceil(g_bytes / (25 * 2**20)))  # DDP's 25 MiB buckets
    units = (model.layers // pp + 1 if model.is_decoder  # layers, each its own collective, and the rest
             else len({name.rsplit(".", 1)[0] for name, _ in model.tensors}))
    if shard == 0:  # DDP, no_sync() while accumulating: one all-reduce a step
        result.comm.append(("gradients", "all_reduce", g_bytes, dp, dp_link, 1, buckets))
    elif shard == 1:  # torch's: DDP's all-reduce, then each tensor broadcast by its owner (a gather's bytes)
        result.comm += [("gradients", "all_reduce", g_bytes, dp, dp_link, 1, buckets),
                        ("parameters", "all_gather", p_bytes, dp, dp_link, 1, len(model.tensors))]
    elif shard == 2:  # a gradient shard only: reduce-scattered every micro-batch
        result.comm += [("gradients", "reduce_scatter", g_bytes, dp, dp_link, micro_batches, units),
                        ("parameters", "all_gather", p_bytes, dp, dp_link, 1, units)]
    else:  # each micro-batch gathers every layer for forward and again for backward (fully_shard's default)
        result.comm += [("parameters", "all_gather", p_bytes, group, dp_link, 2 * micro_batches, units),
                        ("gradients", "reduce_scatter", g_bytes, group, dp_link, micro_batches, units)]
        if hybrid:  # and all-reduces its gradient shard across the nodes' replicas, every micro-batch too
            result.comm.append(("gradient shards", "all_reduce", g_bytes / group, dp // group, cluster.inter,
                                micro_batches, units))
    if tp > 1:  # two all-reduces of a layer's output in forward, two in backward (one more pair recomputing)
        activation = model.seq * training.micro_batch * model.hidden * training.param_bytes
        per_layer = 6 if training.recompute else 4
        result.comm.append(("activations (TP)", "all_reduce", activation, tp, cluster.intra,
                            per_layer * model.layers // pp * micro_batches, 1))
    if pp > 1:  # a stage sends each micro-batch's activation on and its gradient back: 2 m messages;
        # on the critical path, 2 (m + p - 1) of them one after another (pipeline_step_s)
        activation = model.seq * training.micro_batch * model.hidden * training.param_bytes / tp
        link = where(pp, tp, cluster)
        result.comm.append(("activations (PP)", "send", activation, 2, link, 2 * micro_batches, 1))
        result.message_s = collective_seconds("send", activation, 2, link)
        result.bubble = (pp - 1) / (micro_batches + pp - 1)

    samples = training.global_batch / dp  # per model replica; tp and pp split its work
    result.compute_s = samples * flops_per_sample(model, training.recompute) / (tp * pp) / cluster.flops
    return result


def strategies(model, training, cluster):
    """Every strategy the planner weighs, with the degrees it tries (the best of each family kept)."""
    n, g = cluster.gpus, cluster.gpus_per_node
    plans = [plan("DDP", model, training, cluster),
             plan("ZeRO-1 (torch's)", model, training, cluster, shard=1),
             plan("ZeRO-2", model, training, cluster, shard=2),
             plan("ZeRO-3 (FSDP)", model, training, cluster, shard=3)]
    if cluster.nodes > 1:
        plans.append(plan("HSDP", model, training, cluster, shard=3, hybrid=True))
    families = {"TP": (0, "tp"), "PP": (0, "pp"), "DP x TP": (0, "tp"), "FSDP x TP": (3, "tp"),
                "DP x PP": (0, "pp")}
    for family, (shard, axis) in families.items():
        pure = "x" not in family  # pure: over all the GPUs (plan() says why not, if it cannot)
        degrees = [n] if pure else [d for d in range(2, (g if axis == "tp" else n) + 1) if n % d == 0]
        options = [plan(family, model, training, cluster, shard=shard, dp=1 if pure else None, **{axis: d})
                   for d in degrees]
        options = [o for o in options if not o.problem] or options[:1]
        plans.append(min(options, key=lambda o: (bool(o.problem), not o.fits, o.step_s(cluster))))
    return plans


def ranking(plans, cluster):
    """Those that fit, fastest first, each with its reason; then those that do not, with why not."""
    fit = sorted((p for p in plans if p.fits and not p.problem), key=lambda p: p.step_s(cluster))
    lines = []
    for i, p in enumerate(fit, 1):
        computing = p.compute_s / (1 - p.bubble)
        bubble = f", bubble {p.bubble:.0%}" if p.bubble else ""
        lines.append(f"{i}. {label(p)}: {p.step_s(cluster):.3g} s a step ({computing:.3g} s computing"
                     f"{bubble}, {p.comm_s(cluster):.3g} s communicating), "
                     f"{p.memory_total / GB:.1f} of {cluster.memory_bytes / GB:.0f} GB")
    for p in plans:
        if p.problem:
            lines.append(f"-  {label(p)}: cannot run: {p.problem}")
        elif not p.fits:
            lines.append(f"-  {label(p)}: does not fit: {p.memory_total / GB:.1f} GB a GPU, of "
                         f"{cluster.memory_bytes / GB:.0f} (largest: {max(p.memory, key=p.memory.get)})")
    return lines


def label(p):
    degrees = [f"{axis} {d}" for axis, d in (("dp", p.dp), ("tp", p.tp), ("pp", p.pp)) if d > 1]
    return f"{p.name}" + (f" ({', '.join(degrees)})" if degrees else "")


def table(plans, cluster):
    rows = ["| strategy | parameters | gradients | optimizer | activations (+ gathered) | total (GB a GPU) | "
            "fits | sent a step (GB) | communicating (s) | computing (s) | step (s) |", "|" + "---|" * 11]
    for p in plans:
        if p.problem:
            rows.append(f"| {label(p)} | {p.problem} |" + " |" * 9)
            continue
        m = p.memory
        rows.append(f"| {label(p)} | {m['parameters'] / GB:.2f} | {m['gradients'] / GB:.2f} | "
                    f"{m['optimizer'] / GB:.2f} | {(m['activations'] + m.get('gathered', 0)) / GB:.2f} | "
                    f"{p.memory_total / GB:.2f} | {'yes' if p.fits else 'no'} | "
                    f"{p.sent_bytes(cluster.backend) / GB:.3g} | {p.comm_s(cluster):.3g} | "
                    f"{p.compute_s / (1 - p.bubble):.3g} | {p.step_s(cluster):.3g} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- against the course's runs
# What each --shard of lesson 10's scripts is to the planner: (stage, dealing) for state_bytes.
SCRIPT_STAGES = {"ddp": (0, "even"), "zero": (1, "torch"), "fsdp": (3, "even"),  # mnist_fsdp.py
                 "zero1": (1, "torch"), "zero2": (2, "torch"), "zero3": (3, "torch")}  # sharding_by_hand.py
LAB_RATES = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}  # the network lab's tc caps, bits/s


def lesson_10_mlp():
    """Lesson 10's MLP (mnist_parts.build_model("mlp")) on the meta device: shapes, saved tensors, flops."""
    import torch
    from mnist_parts import build_model

    with torch.device("meta"):
        return Model.from_module(build_model("mlp"), torch.zeros(1, 1, 28, 28))


def state_checks(measured):
    """For each run of a bench_fsdp.py file (docs/measured/fsdp.json): (script, --shard, ranks, the
    fullest rank's state counted from its tensors, predicted), bytes, AdamW in fp32."""
    model, training = lesson_10_mlp(), Training("adam", "fp32")
    runs = [("mnist_fsdp.py", r["mode"], r["ranks"], r["state_mib"] * 2**20) for r in measured["rows"]]
    runs += [("sharding_by_hand.py", r["shard"], r["ranks"], max(r["state_bytes_per_rank"]))
             for r in measured["by_hand"]]
    return [(script, shard, n, counted, sum(state_bytes(model, training, *SCRIPT_STAGES[shard][:1], n,
                                                        SCRIPT_STAGES[shard][1]).values()))
            for script, shard, n, counted in runs]


def lab_all_reduce_checks(lab):
    """For each capped run of a bench_netlab.py file (docs/measured/netlab*.json): (rate, bytes,
    measured s, predicted s, whether the bytes dominate: their term at least twice the latency's). Alpha and
    the hosts' bandwidth are fitted on the uncapped link alone (lesson 9's fit, stored with the run); a
    capped link's bandwidth is the lower of the hosts' and its cap."""
    fit = next(r for r in lab["rates"] if r["rate"] == "none")["all_reduce"]["fit"]["torch"]
    rows = []
    for rate in (r for r in lab["rates"] if r["rate"] in LAB_RATES):
        link = Link(fit["alpha_s"], min(fit["bandwidth_bytes_per_s"], LAB_RATES[rate["rate"]] / 8))
        for row in rate["all_reduce"]["rows"]:
            predicted = collective_seconds("all_reduce", row["bytes"], 2, link, "gloo")
            rows.append((rate["rate"], row["bytes"], row["torch_s"], predicted,
                         2 * link.latency_s <= predicted / 3))
    return rows


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--layers", type=positive(int), required=True, help="decoder layers")
    p.add_argument("--hidden", type=positive(int), required=True, help="hidden size h")
    p.add_argument("--heads", type=positive(int), required=True, help="attention heads")
    p.add_argument("--vocab", type=positive(int), default=32000)
    p.add_argument("--seq", type=positive(int), default=2048, help="sequence length, tokens")
    p.add_argument("--optimizer", choices=list(OPTIMIZER_BYTES), default="adam",
                   help="sgd, momentum (SGD with momentum), adam (or AdamW)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    p.add_argument("--micro-batch", type=positive(int), default=1, help="sequences per GPU per forward")
    p.add_argument("--global-batch", type=positive(int), default=None,
                   help="sequences per step, all GPUs (default: one micro-batch per GPU)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--no-flash-attention", action="store_true",
                   help="attention keeps its s x s scores for backward (Korthikanti et al.'s count)")
    p.add_argument("--nodes", type=positive(int), default=1)
    p.add_argument("--gpus-per-node", type=positive(int), default=8)
    p.add_argument("--gpu-memory-gb", type=positive(float), default=80.0)
    p.add_argument("--tflops", type=positive(float), default=400.0,
                   help="achieved TFLOP/s per GPU (a fraction of the datasheet's peak)")
    p.add_argument("--intra-gbps", type=positive(float), default=1200.0,
                   help="Gbit/s one way per GPU within a node (NVLink-class: 1200)")
    p.add_argument("--intra-latency-us", type=positive(float), default=5.0)
    p.add_argument("--inter-gbps", type=positive(float), default=400.0,
                   help="Gbit/s one way per GPU between nodes (one 400 Gbit/s NIC each)")
    p.add_argument("--inter-latency-us", type=positive(float), default=10.0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        raise UsageError(f"--hidden {args.hidden} does not split into --heads {args.heads}")
    gpus = args.nodes * args.gpus_per_node
    if args.global_batch is None:
        args.global_batch = args.micro_batch * gpus
    if args.global_batch % args.micro_batch:
        raise UsageError(f"--global-batch {args.global_batch} is not a whole number of --micro-batch "
                         f"{args.micro_batch}")
    return args


def main(args):
    model = Model.decoder(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    training = Training(args.optimizer, args.precision, args.micro_batch, args.global_batch, args.recompute,
                        not args.no_flash_attention)
    cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_memory_gb * GB, args.tflops * 1e12,
                      Link(args.intra_latency_us * 1e-6, args.intra_gbps * 1e9 / 8),
                      Link(args.inter_latency_us * 1e-6, args.inter_gbps * 1e9 / 8), args.backend)
    plans = strategies(model, training, cluster)
    print(f"a decoder of {model.params / 1e9:.2f} billion parameters, {args.optimizer}, {args.precision}, "
          f"micro-batch {args.micro_batch}, global batch {args.global_batch}, on {args.nodes} x "
          f"{args.gpus_per_node} GPUs of {args.gpu_memory_gb:g} GB\n")
    print(table(plans, cluster))
    print("\n" + "\n".join(ranking(plans, cluster)))


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {err}")
