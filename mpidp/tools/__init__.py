"""The tools wing: `python -m mpidp doctor`, the `mpidprun` launcher, the knob table."""
