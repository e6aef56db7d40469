"""GPU-aware admission control for inference services: priority buckets, adaptive limits, a breaker."""
