"""Where a server really listens, read from the kernel (/proc/net/tcp and tcp6), not from its log:
the addresses bound to a local port in the LISTEN state."""

from __future__ import annotations

import socket
from pathlib import Path

_LISTEN = "0A"


def listen_addresses(port: int) -> set[str]:
    """IP addresses with a socket listening on `port` (e.g. {"127.0.0.1"}; {"0.0.0.0"} = all)."""
    out = set()
    for name, family, width in (("tcp", socket.AF_INET, 4), ("tcp6", socket.AF_INET6, 16)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            addr, p = cols[1].split(":")
            if cols[3] != _LISTEN or int(p, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            out.add(socket.inet_ntop(family, raw))
    return out
