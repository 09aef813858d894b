"""The fault drill behind ``trainguard demo``."""
