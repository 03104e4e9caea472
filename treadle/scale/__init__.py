"""Scale on paper: memory per GPU and role (:mod:`.memory`), placements that fit
(:mod:`.plan`), and a discrete-event model of RL steps (:mod:`.simulate`), for a model shape
(:mod:`.shapes`) on a GPU type (:mod:`.hardware`). Pure Python: no torch, no device.

The calibration against published figures lives in :mod:`.published` and SCALE.md.
"""
