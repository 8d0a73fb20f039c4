"""Adapters that put pepo's strategies into other trainers' loops (TRL, verl).

Each adapter needs its framework installed; the core they call needs torch alone.
"""
