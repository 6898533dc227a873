"""Multi-head attention, from intuition to GPU: the code of the course."""
