"""The replay simulator: real traces through the real engine, under a simulated clock."""
