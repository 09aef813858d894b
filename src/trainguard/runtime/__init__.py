"""Process lifecycle: launching, supervising and stopping training processes."""
