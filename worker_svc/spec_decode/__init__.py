"""Speculative decoding on the worker: draft proposers and their configuration.

The worker proposes draft tokens after it samples a sequence's next token; the scheduler
schedules them in the next plan, whose forward verifies them (`Sampler.verify_async`).
"""
