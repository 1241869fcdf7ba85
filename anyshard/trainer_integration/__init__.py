"""trainer_integration."""
