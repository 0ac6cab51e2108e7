"""What a problem is: keys, the device it runs on, settings."""
