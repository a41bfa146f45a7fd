"""``pallas-tune report``: placeholder replaced below."""
from typing import Any


def add_parser(sub: Any) -> None:
    pass
