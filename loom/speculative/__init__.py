"""Speculative decoding: drafters propose token trees, the target verifies them losslessly.

    config.py       speculative_config (method, draft size, drafter knobs)
    drafters/       the Drafter interface, its registry and one module per method
    tree.py         draft trees and their attention masks
    verify.py       the walk down a tree: each row's token taken as plain decoding takes it
    calibration.py  the cost model's timed forward passes, cleaned of slow outliers, cached per machine
    controller.py   the step's draft budget, per sequence, from measured acceptance and cost
    datastore.py    token n-grams of a user corpus and of finished requests (retrieval drafting)
    decoder.py      the runner's side: verify, compact accepted KV, observe, propose
"""
