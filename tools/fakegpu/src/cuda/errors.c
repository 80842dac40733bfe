/* cuGetErrorName / cuGetErrorString over a table generated from the real cuda.h. */
#include "internal.h"

static const struct {
    int value;
    const char *name;
    const char *text;
} g_errors[] = {
#include "cuda_errors.inc"
};

static int find_error(CUresult error)
{
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].value == (int)error)
            return (int)i;
    return -1;
}

FG_API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    int i = find_error(error);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = i >= 0 ? g_errors[i].name : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    int i = find_error(error);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = i >= 0 ? g_errors[i].text : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
