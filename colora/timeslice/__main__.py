"""`python -m colora.timeslice SOCK [--policy lazy] [--log timeslice.jsonl] [--parent PID]`: the broker."""

from .process import main

main()
