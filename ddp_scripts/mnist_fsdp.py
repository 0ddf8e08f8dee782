"""Sharding (torch >= 2.6): lesson 3's training, its state split across the ranks by ZeRO or FSDP.

    python mnist_fsdp.py --shard fsdp --metrics-json m.json   # state_mib_per_rank: what each rank holds
    python mnist_fsdp.py --backend gloo --device cpu --nprocs 2 --shard zero   # no GPU: the same on CPU
    torchrun --nproc-per-node 2 mnist_fsdp.py --global-batch-size 240 --checkpoint-dir ckpt --max-steps 99
    torchrun --nproc-per-node 3 mnist_fsdp.py --global-batch-size 240 --resume-from ckpt   # 2 -> 3 ranks

Under DDP every rank holds all the parameters, their gradients and AdamW's state (twice the model):
--shard zero splits AdamW's state across the ranks, --shard fsdp (FSDP2's fully_shard, public in
torch.distributed.fsdp since torch 2.6) every one of those tensors.
Compare it with mnist_ddp_gpu.py, whose launching it runs: the diff is what sharding adds.
"""
import json
import math
import os
import resource
import shutil
import sys

try:  # lesson 3's script, which imports the course's modules: copy them beside this file
    import mnist_ddp_gpu as lesson3  # lesson 3's launching, command line and epoch, kept as they are
except ModuleNotFoundError as missing:  # copied alone: one line names the file (no torch: Python's error)
    raise missing if missing.name != "mnist_ddp_gpu" else SystemExit(
        f"{os.path.basename(sys.argv[0])}: error: mnist_ddp_gpu.py is missing: copy it from ddp_scripts/")
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as fsdp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hardening as hardening  # each call into it says what plain code it stands for
from ddp_hardening import UsageError, check_writable, positive, write_metrics
from mnist_parts import Report, build_model, evaluate, load_split


# --------------------------------------------------------------------------- training
def train(rank, local_rank, world_size, args):
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    # The batch per rank: --global-batch-size G split over the ranks, or --batch-size.
    batch = args.global_batch_size // world_size if args.global_batch_size else args.batch_size
    # MNIST (220 MB as floats) fits on any GPU: each rank keeps the whole set on its own device
    # and gathers a batch with one indexing kernel. No host-to-device copy per step, no per-sample
    # collate. For data that does not fit: DataLoader(..., pin_memory=True), then
    # x.to(device, non_blocking=True), so that the host goes on while the GPU copies.
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True, device=device)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False, device=device)

    # 2. Instantiate the model on this rank's GPU, then wrap it, or shard it. The same seed gives
    #    every rank the same start (DDP would broadcast rank 0's weights anyway; fully_shard sends
    #    nothing, and relies on it); a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    if args.shard == "fsdp":
        # FSDP2: fully_shard makes each parameter of a layer a DTensor split along dim 0 across
        # the mesh (all ranks): rank r keeps block r of N blocks of rows. Forward, and backward,
        # all-gather the layer whole and free it after; backward reduce-scatters the gradients, so
        # each rank gets the average of its own rows. A unit per layer, then the root for the rest
        # (reshard_after_forward's default: inner units free their layer after forward, the root not).
        mesh = init_device_mesh(device.type, (world_size,))
        for layer in model.modules():
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
    else:  # DDP as in lesson 3; device_ids names this rank's GPU
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + rank)
    # AdamW keeps two running averages per parameter: its state is twice the model's size.
    if args.shard == "zero":
        # ZeRO stage 1: the parameters are dealt out whole into N shares; each rank keeps AdamW's
        # state for its share only, updates that share after the all-reduce, and broadcasts the
        # updated parameters to the others.
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    else:  # under DDP, of the whole parameters; under FSDP, of the shards: its state sharded as they are
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    amp_dtype, scaler = lesson3.mixed_precision(args.amp, device)  # --amp: autocast's dtype, fp16's scaler

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    #    So step k trains on samples kG to kG + G - 1 of it (G: the global batch) for any N: with
    #    --global-batch-size G, a run resumed on other ranks takes the same steps (if G divides the data).
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    report = Report(args, rank, world_size, batch_size=batch, device=args.device, amp=args.amp,
                    backend=args.backend, shard=args.shard, global_batch_size=batch * world_size)
    report.say(f"training {args.model} on {args.dataset}, --shard {args.shard}: {world_size} processes on "
               f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
               f"({args.backend}, amp {args.amp}), batch {batch} per process ({batch * world_size} in all)")
    steps = 0
    if args.resume_from:  # the steps taken, the weights and AdamW's state, on any number of ranks
        steps = load_checkpoint(args, model, optimizer)
        report.say(f"resumed from {args.resume_from} after {steps} steps")
    steps_per_epoch = math.ceil(len(sampler) / batch)
    first_epoch, skip = steps // steps_per_epoch + 1, steps % steps_per_epoch
    for epoch in range(first_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # This rank's samples, copied to the device once an epoch: a batch is a slice of them.
        batches = torch.tensor(list(sampler), device=device).split(batch)
        batches = batches[skip:] if epoch == first_epoch else batches  # resumed: the steps left
        # plain: bar = tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(batches, f"epoch {epoch}", rank == 0 and not args.quiet)
        # 4. Lesson 3's epoch. In each backward DDP (and ZeRO) all-reduce the gradients, FSDP
        #    reduce-scatters them; the optimizer step then updates, under DDP, all of the model on
        #    every rank; under ZeRO a share on each, sent to the others; under FSDP each rank's rows.
        loss_sum, seen, steps, seconds = lesson3.train_epoch(model, optimizer, scaler, amp_dtype,
                                                             train_images, train_labels, bar, steps,
                                                             args.max_steps)

        # What this rank holds now, after a step: measured, not computed from the sizes.
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (state_bytes(model, optimizer) / 2**20, peak_mib(device)))
        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. DDP's plain
        #    model.module needs no gradient synchronisation; FSDP's model gathers its layers.
        plain = model.module if isinstance(model, DDP) else model
        test_loss, test_accuracy = evaluate(plain, test_images, test_labels, rank, world_size)
        report.fields.update(state_mib_per_rank=[s for s, _ in per_rank],
                             peak_mib_per_rank=[p for _, p in per_rank])
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        if args.checkpoint_dir:  # after every epoch, and the last one cut short by --max-steps
            save_checkpoint(args, model, optimizer, steps, steps // steps_per_epoch, batch * world_size)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    # 7. Print and save on rank 0 only; but every rank gathers: FSDP all-gathers each tensor from its
    #    shards (full_state_dict) onto rank 0's CPU (cpu_offload). Plain names in every mode.
    if args.save:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)  # empty on the other ranks
    report.done(steps)
    if rank == 0 and args.save:
        torch.save(weights, args.save)


def state_bytes(model, optimizer):
    """Bytes of the parameters, gradients and optimizer state that this rank holds: of a DTensor
    (FSDP) its local shard only; of ZeRO's optimizer, the AdamW inside it (this rank's share)."""
    from torch.distributed.tensor import DTensor  # public from torch 2.5 on

    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for state in local.state.values() for t in state.values() if torch.is_tensor(t))]
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def peak_mib(device):
    """Peak memory: on a GPU what torch allocated; on a CPU the whole process's (libraries, data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def save_checkpoint(args, model, optimizer, steps, epochs_done, global_batch):
    """With torch.distributed.checkpoint (DCP) every rank writes the shards it holds into
    DIR/step-<steps>/, with a map of what part of which tensor each is. Then rank 0 points
    DIR/latest.json at it and removes the one before: a crash while writing leaves the previous
    one in use. DIR: a folder every rank can reach (on several machines, a shared filesystem)."""
    model_state, optim_state = get_state_dict(model, optimizer)  # DTensors under FSDP: no gathering
    folder = f"step-{steps}"
    dcp.save({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(args.checkpoint_dir, folder))  # a collective: every rank
    if dist.get_rank() == 0:
        latest = os.path.join(args.checkpoint_dir, "latest.json")
        before = read_checkpoint(args.checkpoint_dir)["folder"] if os.path.exists(latest) else None
        write_metrics(latest, {"folder": folder, "steps": steps, "epochs_done": epochs_done,
                               "model": args.model, "shard": args.shard, "global_batch_size": global_batch,
                               "world_size": dist.get_world_size()})
        if before not in (None, folder):
            shutil.rmtree(os.path.join(args.checkpoint_dir, before), ignore_errors=True)


def read_checkpoint(folder):
    """DIR/latest.json of a checkpoint folder (what save_checkpoint wrote), or a one-line refusal."""
    try:
        with open(os.path.join(folder, "latest.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UsageError(f"{folder} holds no checkpoint of this script ({type(err).__name__}: no "
                         f"readable latest.json); --checkpoint-dir writes one") from None


def load_checkpoint(args, model, optimizer):
    """Resume: each rank asks DCP for the parts of each tensor that it holds now, whatever the
    number of ranks that wrote them (DCP's map gives each tensor's whole shape, each shard's place
    in it): 2 ranks' shards load into 1 or 3. Returns the number of steps taken."""
    meta = read_checkpoint(args.resume_from)
    model_state, optim_state = get_state_dict(model, optimizer)  # this run's tensors, to fill in
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(args.resume_from, meta["folder"]))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group in optimizer.param_groups:  # this run's --lr, not the checkpoint's
        group["lr"] = args.lr
    return meta["steps"]


# --------------------------------------------------------------------------- launching: lesson 3's
def check_setup(args, rank):
    """Lesson 3's checks, then this lesson's: what sharding needs, where the checkpoints go."""
    lesson3.check_setup(args, rank)
    check_sharding(args, world_size=int(os.environ.get("WORLD_SIZE", args.nprocs)))
    if rank == 0 and args.checkpoint_dir:
        check_writable(os.path.join(args.checkpoint_dir, "latest.json"))


def check_sharding(args, world_size):
    """What this torch, the ranks or a checkpoint cannot do; world_size: the ranks of this run."""
    if not hasattr(fsdp, "fully_shard"):
        raise UsageError(f"this script needs torch >= 2.6 (fully_shard in torch.distributed.fsdp), "
                         f"this is torch {torch.__version__}: upgrade torch (the other lessons run on 2.3)")
    global_batch = args.global_batch_size or args.batch_size * world_size
    if global_batch % world_size:
        raise UsageError(f"--global-batch-size {global_batch} does not split evenly over {world_size} "
                         f"ranks: choose a multiple of {world_size}")
    if args.shard == "zero" and (args.checkpoint_dir or args.resume_from):
        raise UsageError("--shard zero has no sharded checkpoint (ZeroRedundancyOptimizer gathers "
                         "AdamW's state onto one rank to save it): use --shard fsdp or ddp")
    if args.resume_from:
        meta = read_checkpoint(args.resume_from)
        if meta["model"] != args.model:  # ddp <-> fsdp is fine: the same tensors to DCP
            raise UsageError(f"{args.resume_from} holds --model {meta['model']}, not {args.model}: "
                             f"resume with --model {meta['model']}")
        if meta["global_batch_size"] != global_batch:
            raise UsageError(f"{args.resume_from} was trained with a global batch of "
                             f"{meta['global_batch_size']}, this run's is {global_batch}: pass "
                             f"--global-batch-size {meta['global_batch_size']} to take the same steps")
        if meta["steps"] >= (args.max_steps or math.inf) or meta["epochs_done"] >= args.epochs:
            raise UsageError(f"{args.resume_from} has taken {meta['steps']} steps ({meta['epochs_done']} "
                             f"epochs) already: raise --max-steps or --epochs (they count those too)")


def main(args):
    """Lesson 3's launching, running this file's train() (which shards) and checks."""
    lesson3.main(args, train, check_setup)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = lesson3.parser(__doc__)  # lesson 3's flags; this lesson's own below
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="mlp")
    p.add_argument("--global-batch-size", type=positive(int), default=None,
                   help="the batch of all ranks together (instead of --batch-size per rank): keep it "
                        "when changing the number of ranks, and every step stays the same")
    p.add_argument("--lr", type=positive(float), default=1e-3, help="AdamW's learning rate")
    p.add_argument("--shard", choices=["ddp", "zero", "fsdp"], default="fsdp",
                   help="ddp: all on every rank; zero: AdamW's state sharded (ZeroRedundancyOptimizer); "
                        "fsdp (default): parameters, gradients and AdamW's state sharded (fully_shard)")
    p.add_argument("--checkpoint-dir", type=str, default=None, metavar="DIR",
                   help="after every epoch (and at --max-steps), save the model and AdamW's state "
                        "as shards with torch.distributed.checkpoint into DIR")
    p.add_argument("--resume-from", type=str, default=None, metavar="DIR",
                   help="continue from DIR's checkpoint on any number of ranks, with the same --model "
                        "and global batch; --max-steps and --epochs count its steps too. The steps are "
                        "the uninterrupted run's, but for dropout (convnet), which draws anew")
    p.add_argument("--save", type=str, default=None,
                   help="write the final state_dict here: whole, plain (loads into build_model()) "
                        "in every mode")
    return lesson3.parse_args(argv, p)


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
