"""Block-wise integer codecs for the cross-node hop of a hierarchical collective (ZeRO++'s qwZ
and qgZ, Wang et al. 2023), in torch so they run on any device.

A tensor is flattened, padded with zeros to a whole number of blocks of `block` elements, and
each block `b` is stored as integers `q = round(x / s_b)` in `[−L, L]` with one fp32 scale
`s_b = absmax_b / L`: `L = 127` for int8 (one byte per element), `L = 7` for int4 (two
elements per byte). A block of zeros has scale 0 and decodes to zeros. Padding is zeros, so it
never raises a block's absmax, and it is cut off after decoding: any length works.

Error bound (round to nearest): every decoded element is within half a step of its value,

    |decode(encode(x))_i − x_i| ≤ s_b / 2 = absmax_b / (2·L)

(plus float rounding of the division, a few ulps of `absmax_b`). A value that crosses `h`
quantized hops accumulates at most the sum of each hop's bound: the hierarchical all-gather
quantizes each shard once (`h = 1`), the hierarchical reduce-scatter quantizes each node's
partial sum once on its way to the rank that owns the chunk, so an element of the result is off
by at most `Σ_j absmax_{j,b} / (2·L)` over the `m − 1` other nodes' blocks (divided by the
group size for a mean). Bytes on the wire per tensor of `N` elements: `⌈N/block⌉·block` bytes
(int8) or half that (int4), plus `4·⌈N/block⌉` bytes of scales (`encoded_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.plugins.collectives import step_bytes

__all__ = ["CODECS", "Codec", "codec_named", "encoded_bytes"]


@dataclass(frozen=True, slots=True)
class Codec:
    """A block-wise symmetric integer codec: `levels` = L, `per_byte` elements per byte."""

    name: str
    levels: int
    per_byte: int
    block: int = 256

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def payload_numel(self, numel: int) -> int:
        """Bytes (uint8 elements) of the integer payload of `numel` values."""
        return self.blocks(numel) * self.block // self.per_byte

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload as uint8, fp32 scales per block) of `x` (any shape and length)."""
        flat = x.detach().reshape(-1).float()
        blocks = F.pad(flat, (0, self.blocks(flat.numel()) * self.block - flat.numel()))
        blocks = blocks.view(-1, self.block)
        scales = blocks.abs().amax(dim=1) / self.levels
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / divisor[:, None]).clamp_(-self.levels, self.levels)
        q = q.to(torch.int8).view(-1)
        if self.per_byte == 2:
            low, high = q[0::2], q[1::2]  # block is even: pairs never straddle blocks
            q = (low & 0x0F) | (high << 4)
        return q.view(torch.uint8), scales

    def decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of `numel` elements encoded as (`payload`, `scales`)."""
        q = payload.view(torch.int8)
        if self.per_byte == 2:
            # Sign-extend each nibble: shift it to the top of the byte, then back.
            low = (q << 4) >> 4
            high = q >> 4
            q = torch.stack((low, high), dim=1).view(-1)
        values = q.view(-1, self.block).float() * scales[:, None]
        return values.view(-1)[:numel]

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of `x` (flattened): `absmax` of its block over `2·L`."""
        flat = x.detach().reshape(-1).float()
        blocks = F.pad(flat, (0, self.blocks(flat.numel()) * self.block - flat.numel()))
        absmax = blocks.view(-1, self.block).abs().amax(dim=1)
        return (absmax / (2 * self.levels)).repeat_interleave(self.block)[: flat.numel()]


CODECS = {"int8": Codec("int8", 127, 1), "int4": Codec("int4", 7, 2)}


def codec_named(name: str, block: int = 256) -> Codec:
    """The codec `name` ("int8" or "int4") with blocks of `block` elements (even)."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    if block < 2 or block % 2:
        raise ValueError(f"a codec block must be an even number of elements, got {block}")
    base = CODECS[name]
    return Codec(base.name, base.levels, base.per_byte, block)


def encoded_bytes(numel: int, codec: Codec) -> int:
    """Bytes that encode `numel` values: the integer payload and the fp32 scales
    (`plait.plugins.collectives.step_bytes.encoded_bytes`)."""
    return step_bytes.encoded_bytes(numel, bits=8 // codec.per_byte, block=codec.block)
