"""A reward function of your own: 1.0 when the completion's last number is the gold answer.

A recipe names it by import path, found from the folder treadle runs in (here the repository's
root) or on PYTHONPATH: ``reward.functions: [{name: examples.custom_reward:last_number}]``
(recipes/custom_reward.yaml). Any module-level ``(task, completion) -> float`` function works.
"""

import re


def last_number(task, completion: str) -> float:
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and numbers[-1] == task.answer.strip() else 0.0
