"""Georeferenced scenes (data.dataset=raster): image rasters read as windows, labels as label rasters or vector
files on the scene's grid, nodata as the ignore label (rasterio and fiona: the `geo` extra).

    scenes.py    a raster's header, windows in the config's format with their valid pixels, RasterError
    labels.py    label rasters and vector files drawn into windows; data.val_region as windows
    dataset.py   RasterSegmentation: random training chips outside the validation region, grids for validation
"""
