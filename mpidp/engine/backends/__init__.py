"""Data paths behind one interface: `execute(batch, entries)` runs a negotiated batch."""


def make_backend(comms, config):
    """The data path for one engine, chosen by the `backend` knob."""
    from .host import HostBackend
    return HostBackend(comms.world, config)
