"""Built-in plait plugins: one subpackage per strategy, schedule, kernel set or model family."""
