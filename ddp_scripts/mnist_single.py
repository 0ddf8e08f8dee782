"""Lesson 1: train an MNIST classifier in ONE process (the baseline for every DDP lesson).

    python mnist_single.py --model convnet --epochs 1
    python mnist_single.py --model linear --batch-size 128 --max-steps 50 --no-shuffle

It imports the MNIST pieces (data, models, evaluation) from mnist_parts.py and the command line's
pieces from ddp_hardening.py: copy them beside it. It needs torch (torchvision to download, tqdm
optional). Compare it with mnist_ddp_cpu.py: the diff is the DDP lesson.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:  # the course's pieces, written once: copy these files beside this one
    from ddp_hardening import Parser, UsageError, check_writable, cpu_cores, positive, progress, write_metrics
    from mnist_parts import build_model, evaluate, load_split, prepare_data
except ModuleNotFoundError as missing:
    sys.exit(f"{os.path.basename(sys.argv[0])}: error: {missing.name}.py is missing: copy it from the "
             f"course's ddp_scripts/ into {os.path.dirname(os.path.abspath(sys.argv[0]))}")


# --------------------------------------------------------------------------- training
def train(args):
    torch.set_num_threads(args.threads_per_proc)
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    train_set = TensorDataset(train_images, train_labels)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=not args.no_shuffle,
                        generator=torch.Generator().manual_seed(args.seed))

    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"training {args.model} on {args.dataset}: 1 process, {args.threads_per_proc} torch "
        f"thread(s), batch {args.batch_size}", flush=True)
    history, steps, start = [], 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        bar = progress(loader, f"epoch {epoch}", not args.quiet)
        for x, y in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(y)
            seen += len(y)
            steps += 1
            if steps == args.max_steps:
                break
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        test_loss, test_accuracy = evaluate(model, test_images, test_labels)
        history.append({"epoch": epoch, "train_loss": loss_sum / seen, "test_loss": test_loss,
                        "test_accuracy": test_accuracy, "seconds": seconds,
                        "images_per_second": seen / seconds, "steps": steps})
        log(f"epoch {epoch}: train loss {loss_sum / seen:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_accuracy:.2%}  {seconds:.1f} s  {seen / seconds:,.0f} images/s",
            flush=True)
        if args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": 1,
                "model": args.model, "dataset": args.dataset, "batch_size": args.batch_size,
                "threads_per_proc": args.threads_per_proc, "epochs": history})
        if steps == args.max_steps:
            break

    last = history[-1]
    print(f"done: {args.model} on {args.dataset}, 1 process, {steps} steps, "
          f"test accuracy {last['test_accuracy']:.2%}, {last['images_per_second']:,.0f} images/s, "
          f"{time.perf_counter() - start:.1f} s in all", flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


def main(args):
    check_writable(args.save, args.metrics_json)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    train(args)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", choices=["linear", "convnet"], default="convnet")
    p.add_argument("--dataset", choices=["auto", "mnist", "fashion-mnist"], default="auto",
                   help="auto: MNIST if present or downloadable, else Fashion-MNIST")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64)
    p.add_argument("--lr", type=positive(float), default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None,
                   help="stop after this many optimizer steps in total")
    p.add_argument("--no-shuffle", action="store_true", help="fixed sample order")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads (default: all cores)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    args = p.parse_args(argv)
    if args.threads_per_proc is None:
        args.threads_per_proc = cpu_cores()
    return args


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
