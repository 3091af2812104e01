"""Speculative decoding: drafters propose token trees, the target verifies them losslessly.

    config.py       speculative_config (method, draft size, drafter knobs)
    drafters/       the Drafter interface, its registry and one module per method
    tree.py         draft trees and their attention masks
    verify.py       greedy matching and recursive rejection sampling over a tree
    controller.py   draft size per sequence and step, from measured acceptance and cost
    decoder.py      the runner's side: verify, compact accepted KV, observe, propose
"""
