"""Lesson 1: train an MNIST classifier in ONE process (the baseline for every DDP lesson).

    python mnist_single.py --model convnet --epochs 1
    python mnist_single.py --model linear --batch-size 128 --max-steps 50 --no-shuffle

It imports the MNIST pieces (data, models, evaluation, flags, report) from mnist_parts.py, the command line's
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
    from ddp_hardening import Parser, check_writable, cpu_cores, positive, progress, run_main
    from mnist_parts import Report, add_training_flags, build_model, evaluate, load_split, prepare_data
except ModuleNotFoundError as missing:
    sys.exit(f"{os.path.basename(sys.argv[0])}: error: {missing.name}.py is missing: copy it from the "
             f"course's ddp_scripts/ into {os.path.dirname(os.path.abspath(sys.argv[0]))}")


# --------------------------------------------------------------------------- training
def train(args):
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    train_set = TensorDataset(train_images, train_labels)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=not args.no_shuffle,
                        generator=torch.Generator().manual_seed(args.seed))

    report = Report(args)  # its lines, the metrics JSON after each epoch, the `done:` summary
    report.say(f"training {args.model} on {args.dataset}: 1 process, {args.threads_per_proc} torch "
               f"thread(s), batch {args.batch_size}")
    steps = 0
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
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        if steps == args.max_steps:
            break

    report.done(steps)
    if args.save:
        torch.save(model.state_dict(), args.save)


def main(args):
    torch.set_num_threads(args.threads_per_proc)
    check_writable(args.save, args.metrics_json)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    train(args)


# --------------------------------------------------------------------------- command line
def parser(doc=__doc__):
    """Lesson 1's command line: the training flags of mnist_parts.py, and the threads."""
    p = Parser(doc)
    add_training_flags(p)  # lesson 1's: --model --dataset --epochs --batch-size --lr ... (mnist_parts.py)
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads (default: all cores)")
    return p


def parse_args(argv=None):
    args = parser().parse_args(argv)
    args.threads_per_proc = args.threads_per_proc or cpu_cores()
    return args


if __name__ == "__main__":
    run_main(main, parse_args)  # main(parse_args()), a mistake said in one line, no traceback
