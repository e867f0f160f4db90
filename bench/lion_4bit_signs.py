#!/usr/bin/env python3
"""Why memsave has no 4-bit Lion: a running average kept on the 4-bit book goes stale where beta is 0.99.

Simulates one moment m <- beta * m + (1 - beta) * g kept in fp32 and kept as 4-bit codes (the signed 16-value
book of tests/data/golden.txt, blocks of 128, one absmax each, nearest code after every step, as memsave's
kernels do), over gradients whose per-element means flip sign halfway. Prints, at steps after the flip, the
fraction of elements where the 4-bit moment has the fp32 moment's sign: what Lion's update, sign(beta1 * m +
(1 - beta1) * g), depends on. beta 0.9 is Adam's first moment (and SGD's buffer moves by whole gradients); 0.99
is Lion's default beta2.

    .venv/bin/python bench/lion_4bit_signs.py
"""
import numpy as np

BLOCK = 128


def signed_book_4bit(golden="tests/data/golden.txt"):
    for line in open(golden):
        name, *values = line.split()
        if name == "codebook4.signed":
            return np.array([float.fromhex(v) for v in values])
    raise SystemExit("no codebook4.signed in " + golden)


def quantized(x, book):
    blocks = x.reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    absmax[absmax == 0] = 1
    codes = np.abs((blocks / absmax)[..., None] - book).argmin(axis=-1)
    return (book[codes] * absmax).reshape(-1)


def main():
    book = signed_book_4bit()
    rng = np.random.default_rng(0)
    n, steps, flip = BLOCK * 512, 400, 200
    print("fraction of elements whose 4-bit moment has the fp32 moment's sign (gradient means flip at step 200)")
    print("beta  | " + " | ".join(f"step {t}" for t in (199, 210, 250, 300, 399)))
    for beta in (0.9, 0.99):
        mean = rng.normal(size=n) * 0.5
        m32 = np.zeros(n)
        m4 = np.zeros(n)
        agree = []
        for t in range(steps):
            if t == flip:
                mean = -mean
            g = mean + rng.normal(size=n)
            m32 = beta * m32 + (1 - beta) * g
            m4 = quantized(beta * m4 + (1 - beta) * g, book)
            if t in (199, 210, 250, 300, 399):
                agree.append(np.mean(np.sign(m4) == np.sign(m32)))
        print(f"{beta:<5} | " + " | ".join(f"{a:.3f}" for a in agree))


if __name__ == "__main__":
    main()
