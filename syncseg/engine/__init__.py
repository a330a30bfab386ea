"""The training and inference engine: everything between the command lines and the model/data packages.

    config/          the schema (every key, choice, limit, default) and its YAML / KEY=VALUE io
    build.py         build_training(config, dist_info) -> TrainingParts (datasets ... loaders); init_from_weights
    trainer.py       Trainer(parts): the loop (fit, train_step, what is due between steps); StopTraining
    training_state.py  a run's state: training_payload, Checkpointer (last.pt / best.pt), resume_training, reseeding
    checkpoint_file.py  the checkpoint file format: torch.save / torch.load, keys, peek, safetensors, weight files
    model_from_checkpoint.py  load_inference_model: checkpoint -> config -> model on a device (eval.py, predict.py)
    inference.py     predict_batch: the one inference entry point (validation, eval.py, grids, predict.py)
    evaluate.py      evaluate(): the one evaluation loop; validate_during_training (a run's validation, logged)
    confusion.py     ConfusionMatrix (on device, all-reduced)
    devices.py       --gpus / --device parsing; precision (train.amp / eval.amp) and autocast
    distributed.py   topology (CPU, DataParallelWithCallback, torchrun / srun DDP) and collectives
    run_plan.py      the run dir: lock, fresh or resume, what every rank loads
    object_store.py  fsspec URLs: atomic uploads, checkpoint and data-root downloads;  remote_run_dir.py  a run
                     dir on object storage (staging, uploads, lease);  upload_worker.py  the upload process
    trackers.py      MLflow and W&B beside metrics.jsonl (log.loggers)
    signals.py       stop requests agreed by all ranks
    samplers.py      resumable training batches and the training loader; the non-padding eval loader
    seeding.py       per-sample seeds, worker init, every RNG's state
    loss.py          SegmentationLoss (loss_terms.py: focal, Dice, Lovasz);  accumulation.py  micro-batches of one
                     step;  optim.py  groups, optimizer, LR
    ema.py           the average of the weights;  precise_bn.py  BatchNorm statistics recomputed before validation
    overfitting.py   OverfittingWatch: the one warning that the run memorizes its training pixels
    reporting.py     metrics.jsonl, TensorBoard, progress lines;  visualize.py  grids, legends, overlays
    export_formats.py  ONNX / TorchScript / torch.export / safetensors files, checked against PyTorch
    tool_formats.py  predict.py --format: masks back into COCO / labelme / CVAT / YOLO files
    atomic.py        atomic file writes;  cli.py  the error contract (exit statuses, error lines) of every command

Imports point down only: command lines -> engine -> model, data -> syncseg.model.sync_batchnorm -> torch. Importing
the package imports nothing (no side effects); import the module you need.
"""
