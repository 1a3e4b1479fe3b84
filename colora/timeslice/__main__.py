"""`python -m colora.timeslice SOCK [--policy lazy] [--log timeslice.jsonl] [--parent PID]`: the broker."""

from colora.timeslice.process import main

main()
