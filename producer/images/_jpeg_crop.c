/*
 * decode_crop(data, y, x, h, w, fast) -> (pixels, stride, offset): one window of a JPEG, as RGB rows.
 *
 * libjpeg(-turbo)'s partial decoding, as tf.io.decode_and_crop_jpeg does it: columns
 * outside the window skip the IDCT and colour conversion (jpeg_crop_scanline), rows
 * above it skip the IDCT (jpeg_skip_scanlines), and decoding stops after its last row,
 * so rows below it are never even entropy-decoded. For random-resized-crop that is
 * about a quarter of the decode time saved (benchmarks/decoders.py). Pixels equal a full
 * decode's except in the two columns at each side edge (chroma upsampling there lacks
 * the neighbours outside the decoded MCU columns).
 *
 * Returns (pixels, stride, offset): the window's rows are decoded straight into
 * ``pixels`` (bytes), each ``stride`` pixels wide (the window widened to iMCU
 * boundaries, at most w + MAX_WIDENING), the window starting ``offset`` pixels into
 * each row; RGB, row-major. So no pixel is copied after libjpeg writes it: the caller
 * takes a strided view (augment.decode_train_crop). Raises ValueError with libjpeg's
 * message for any error or warning (corrupt or truncated data), and for a window
 * outside the image. The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

/* jpeg_crop_scanline moves the window's left edge down to an iMCU boundary: at most
 * max_h_samp_factor (<= 4) x DCT size (8) - 1 pixels. */
#define MAX_WIDENING 32

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void error_exit(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void emit_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt or truncated data. Refuse, as simplejpeg's strict mode does. */
        error_exit(cinfo);
    }
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    Py_buffer data;
    int y, x, h, w, fast;
    if (!PyArg_ParseTuple(args, "y*iiiip", &data, &y, &x, &h, &w, &fast)) {
        return NULL;
    }
    if (y < 0 || x < 0 || h <= 0 || w <= 0 || (size_t)h * (size_t)w > ((size_t)1 << 30)) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "invalid crop window y=%d x=%d h=%d w=%d", y, x, h, w);
    }
    const size_t stride_max = (size_t)w + MAX_WIDENING;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((size_t)h * stride_max * 3));
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    JSAMPROW *volatile rows = NULL;
    volatile int failure = 0; /* 1: libjpeg error, 2: window outside the image */
    unsigned int image_w = 0, image_h = 0;
    volatile JDIMENSION stride = 0, offset = 0;

    Py_BEGIN_ALLOW_THREADS
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = error_exit;
    err.pub.emit_message = emit_message;
    err.message[0] = '\0';
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        failure = 1;
    } else {
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        image_w = cinfo.image_width;
        image_h = cinfo.image_height;
        if ((unsigned int)y + (unsigned int)h > image_h || (unsigned int)x + (unsigned int)w > image_w) {
            failure = 2;
        } else {
            cinfo.out_color_space = JCS_RGB;
            cinfo.dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
            cinfo.do_fancy_upsampling = fast ? FALSE : TRUE;
            jpeg_start_decompress(&cinfo);
            JDIMENSION xoffset = (JDIMENSION)x, width = (JDIMENSION)w;
            jpeg_crop_scanline(&cinfo, &xoffset, &width); /* widens to iMCU boundaries */
            stride = cinfo.output_width;
            offset = (JDIMENSION)x - xoffset;
            if (cinfo.output_components != 3 || (size_t)stride > stride_max || offset + (JDIMENSION)w > stride) {
                strcpy(err.message, "unexpected crop widening"); /* never with libjpeg(-turbo) as documented */
                failure = 1;
            } else if ((rows = (JSAMPROW *)malloc((size_t)h * sizeof(JSAMPROW))) == NULL) {
                strcpy(err.message, "out of memory");
                failure = 1;
            } else {
                for (int r = 0; r < h; r++) {
                    rows[r] = dst + (size_t)r * stride * 3;
                }
                if (y > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y) != (JDIMENSION)y) {
                    strcpy(err.message, "could not skip to the crop window");
                    failure = 1;
                }
                for (JDIMENSION r = 0; r < (JDIMENSION)h && !failure;) {
                    JDIMENSION got = jpeg_read_scanlines(&cinfo, rows + r, (JDIMENSION)h - r);
                    if (got == 0) {
                        strcpy(err.message, "premature end of image data");
                        failure = 1;
                        break;
                    }
                    r += got;
                }
            }
        }
    }
    jpeg_destroy_decompress(&cinfo); /* also abandons the rows below the window */
    free(rows);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    if (failure == 2) {
        Py_DECREF(out);
        return PyErr_Format(PyExc_ValueError, "crop window y=%d x=%d h=%d w=%d is outside the %ux%u image",
                            y, x, h, w, image_w, image_h);
    }
    if (failure) {
        Py_DECREF(out);
        return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    }
    return Py_BuildValue("(Nkk)", out, (unsigned long)stride, (unsigned long)offset);
}

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, y, x, h, w, fast) -> (pixels, stride, offset): the RGB rows (h x stride x 3) "
     "holding a window of a JPEG at column offset, decoding only what the window needs. ValueError on any error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_crop", NULL, -1, methods};

/* What decode_crop returns: 2 = (pixels, stride, offset). augment.py refuses a build of another interface. */
#define INTERFACE 2

PyMODINIT_FUNC PyInit__jpeg_crop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "INTERFACE", INTERFACE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
