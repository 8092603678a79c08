"""init() under a too-low MPI thread level must say how to fix it."""

import mpidp

try:
    mpidp.init()
except mpidp.MpidpError as exc:
    print(f"MpidpError: {exc}", flush=True)
    raise SystemExit(5)
print("initialised", flush=True)
