"""Measuring the GPU engine: the models a run loads (`models`), DDTree and AR decoding at controlled acceptance
(`oracle`), the budget x streams x context sweep of `ddtree-run bench` (`sweep`, shown by `view`, written by
`report`) and the graph replays of `ddtree-run profile` (`profile`)."""
