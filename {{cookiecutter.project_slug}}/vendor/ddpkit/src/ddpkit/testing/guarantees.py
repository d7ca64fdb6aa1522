"""Every guarantee the suite checks, as pytest test functions: a project's tests/test_guarantees.py star-imports
this module, and pytest collects the functions there, on the project's own model and data (ddpkit.testing).
"""

from .check_cli import (
    test_a_run_without_logger_leaves_the_projects_config_alone,
    test_an_added_logger_writes_into_the_same_run_directory,
    test_ckpt_path_last_and_best_name_the_file_they_load,
    test_doctor_reports_by_default_without_timing_the_all_reduce,
    test_fit_ckpt_path_last_continues_the_newest_run_in_its_directory,
    test_fit_writes_logs_config_and_checkpoints_under_root,
    test_learning_rate_is_logged_at_every_step_the_logger_writes,
    test_other_subcommands_run_from_a_checkpoint,
    test_the_run_config_reaches_every_logger,
)
from .check_data import (
    test_each_rank_gets_half_of_every_epoch_and_nothing_twice,
    test_eval_metrics_count_each_sample_once,
    test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones,
    test_every_rank_holds_the_same_datasets,
    test_global_batches_equal_1_device_and_reshuffle_each_epoch,
    test_predictions_are_one_file_in_dataset_order_the_same_on_1_and_2_devices,
)
from .check_multinode import (
    test_requeue_signal_saves_a_checkpoint_and_the_requeued_job_resumes_from_it,
    test_slurm_job_of_two_nodes_trains_the_same_weights_as_one_device,
    test_two_torchrun_nodes_train_the_same_weights_as_one_device,
)
from .check_onestep import (
    test_both_ranks_end_bit_identical,
    test_one_step_from_the_same_state_matches_1_vs_2_devices,
)
from .check_parity import (
    test_2_devices_write_one_set_of_files,
    test_checkpoint_written_on_gpus_resumes_on_cpu,
    test_compare_command_fails_another_learning_rate,
    test_compare_command_passes_two_torchrun_nodes_against_one_process,
    test_compare_command_reads_metrics_csv,
    test_csv_logger_is_added_and_its_scalars_match_1_vs_2_devices,
    test_gpu_logged_scalars_match_1_vs_2_gpus,
    test_gpu_weights_match_1_vs_2_gpus,
    test_gradient_accumulation_keeps_the_global_batch,
    test_logged_scalars_match_every_step,
    test_logged_training_values_are_global,
    test_lr_schedule_is_the_same_on_1_and_2_devices,
    test_mid_epoch_checkpoint_records_loader_position,
    test_mid_epoch_resume_on_other_device_count_matches_uninterrupted,
    test_torchrun_matches_lightning_launcher_and_1_device,
    test_weights_match_1_vs_2_devices,
)
from .check_sharded import (
    test_sharded_on_two_then_resumed_on_one_device_matches_ddp,
)

# pytest collects the star-imported tests in this order: first what must hold before runs can be compared, then the
# checks of each wave's runs, wave by wave (waves.py): the first wave's, those that start from its checkpoints, the
# others that read the rounding reference's files, the one-step runs', the SLURM job's. A run's checkpoints are
# deleted once no later test reads it (plugin.pytest_runtest_teardown), so a wave's are gone before a later wave
# writes its own.
__all__ = [
    "test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones",
    "test_every_rank_holds_the_same_datasets",
    # the first wave's runs
    "test_weights_match_1_vs_2_devices",
    "test_logged_scalars_match_every_step",
    "test_logged_training_values_are_global",
    "test_each_rank_gets_half_of_every_epoch_and_nothing_twice",
    "test_global_batches_equal_1_device_and_reshuffle_each_epoch",
    "test_2_devices_write_one_set_of_files",
    "test_mid_epoch_checkpoint_records_loader_position",
    "test_csv_logger_is_added_and_its_scalars_match_1_vs_2_devices",
    "test_compare_command_reads_metrics_csv",
    "test_fit_writes_logs_config_and_checkpoints_under_root",
    "test_an_added_logger_writes_into_the_same_run_directory",
    "test_the_run_config_reaches_every_logger",
    "test_learning_rate_is_logged_at_every_step_the_logger_writes",
    "test_doctor_reports_by_default_without_timing_the_all_reduce",
    # the runs from its checkpoints (the 2 -> 1 resume first)
    "test_checkpoint_written_on_gpus_resumes_on_cpu",
    "test_mid_epoch_resume_on_other_device_count_matches_uninterrupted",
    "test_predictions_are_one_file_in_dataset_order_the_same_on_1_and_2_devices",
    "test_eval_metrics_count_each_sample_once",
    "test_a_run_without_logger_leaves_the_projects_config_alone",
    "test_other_subcommands_run_from_a_checkpoint",
    "test_ckpt_path_last_and_best_name_the_file_they_load",
    "test_fit_ckpt_path_last_continues_the_newest_run_in_its_directory",
    # the others that read the rounding reference's files, in two waves
    "test_compare_command_passes_two_torchrun_nodes_against_one_process",
    "test_two_torchrun_nodes_train_the_same_weights_as_one_device",
    "test_lr_schedule_is_the_same_on_1_and_2_devices",
    "test_compare_command_fails_another_learning_rate",
    "test_gradient_accumulation_keeps_the_global_batch",
    "test_torchrun_matches_lightning_launcher_and_1_device",
    "test_sharded_on_two_then_resumed_on_one_device_matches_ddp",
    # the one-step runs
    "test_one_step_from_the_same_state_matches_1_vs_2_devices",
    "test_both_ranks_end_bit_identical",
    # the SLURM job
    "test_slurm_job_of_two_nodes_trains_the_same_weights_as_one_device",
    "test_requeue_signal_saves_a_checkpoint_and_the_requeued_job_resumes_from_it",
    # on GPUs (none of the CPU runs)
    "test_gpu_weights_match_1_vs_2_gpus",
    "test_gpu_logged_scalars_match_1_vs_2_gpus",
]
